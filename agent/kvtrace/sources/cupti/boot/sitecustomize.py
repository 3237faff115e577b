"""`kvtrace run`'s start-up hook: `kvtrace run` puts this directory first on PYTHONPATH, so every Python
process of the run (children by fork, spawn and exec inherit the environment) imports this module at
start-up, as Python's `site` imports any `sitecustomize`.

It does two things, and neither may change what the program does:
1. runs the `sitecustomize` this one hides (a user's, a virtualenv's or the distribution's, the next one on
   sys.path), exactly as Python would have; an exception from it is raised again at the end, so that `site`
   reports it as it always does;
2. with KVTRACE_CUPTI_SOCKET set, installs kvtrace's CUPTI tracer (kvtrace/sources/cupti/tracer.py), which
   does nothing until the process initialises CUDA. Any failure is one line on stderr.
"""
import importlib
import os
import sys


def _run_hidden_sitecustomize() -> None:
    """Imports the next `sitecustomize` with this directory off sys.path and this module out of
    sys.modules; the one found stays in sys.modules, as it would without kvtrace. Changes it makes to
    sys.path are kept; this directory goes back where it was."""
    here = os.path.dirname(os.path.abspath(__file__))
    ours = [(index, entry) for index, entry in enumerate(sys.path) if os.path.abspath(entry or ".") == here]
    for index, _entry in reversed(ours):
        del sys.path[index]
    this_module = sys.modules.pop("sitecustomize", None)
    try:
        importlib.import_module("sitecustomize")
    except ModuleNotFoundError as error:
        if error.name != "sitecustomize":
            raise
        if this_module is not None:
            sys.modules["sitecustomize"] = this_module  # there was none to run
    finally:
        for index, entry in ours:
            sys.path.insert(min(index, len(sys.path)), entry)


def _install_tracer() -> None:
    if not os.environ.get("KVTRACE_CUPTI_SOCKET"):
        return
    try:
        from kvtrace.sources.cupti import tracer

        tracer.install_from_environment()
    except Exception as error:
        try:
            sys.stderr.write(f"kvtrace: CUPTI tracer not installed: {error}\n")
        except Exception:
            pass


def _main() -> None:
    hidden_error = None
    try:
        _run_hidden_sitecustomize()
    except Exception as error:
        hidden_error = error
    _install_tracer()
    if hidden_error is not None:
        raise hidden_error


_main()
