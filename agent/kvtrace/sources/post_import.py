"""Running code right after a module's own code ran, without the module ever seeing it: the in-process
parts of kvtrace (the vLLM plugin, `kvtrace run`'s CUPTI tracer) patch what they follow this way.
Standard library only: it runs inside the user's processes."""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def wrapped_spec(fullname: str, path: Any, target: Any, own_mark: str, then: Callable[[Any], None]) -> Any:
    """For a meta-path finder that finds nothing itself: the spec the other finders give for `fullname`
    (finders carrying the attribute `own_mark`, ours, are skipped), its loader wrapped so that `then(module)`
    runs after the module's code; None when no other finder has it. A loader without exec_module is left."""
    for finder in sys.meta_path:
        if getattr(finder, own_mark, False):
            continue
        find = getattr(finder, "find_spec", None)
        spec = find(fullname, path, target) if find is not None else None
        if spec is not None:
            break
    else:
        return None
    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
        spec.loader = PostImportLoader(spec.loader, then)
    return spec


class PostImportLoader:
    """Delegates to the module's own loader, then calls `then(module)`. The module's __loader__ and
    __spec__.loader are set back to the original before its code runs (as wrapt's post-import hooks do), so
    nothing inside it sees this wrapper. `then` must not raise: it is the caller's to contain its errors."""

    def __init__(self, loader: Any, then: Callable[[Any], None]) -> None:
        self._loader = loader
        self._then = then

    def __getattr__(self, name: str) -> Any:
        if name in ("_loader", "_then"):  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self._loader, name)

    def create_module(self, spec: Any) -> Any:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: Any) -> None:
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self._loader
        spec = getattr(module, "__spec__", None)
        if spec is not None and getattr(spec, "loader", None) is self:
            spec.loader = self._loader
        self._loader.exec_module(module)
        self._then(module)
