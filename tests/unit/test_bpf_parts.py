"""The BPF source's parts, each with a small stand-in for the probes it touches: the selection tells the
probes' pid filter, stack naming keeps and forgets what it learnt of a process, the attach targets forget
a process's CUDA start."""
import re

from kvtrace.session import Session
from kvtrace.sources.bpf.discovery import Discovery
from kvtrace.sources.bpf.selection import Selection
from kvtrace.sources.bpf.source import BpfOptions
from kvtrace.sources.bpf.stack_names import StackNames
from kvtrace.sources.bpf.targets import AttachPolicy, Targets
from kvtrace.sources.python.runtime import NoPython


class TellingProbes:
    """Records what the parts tell the probes."""

    def __init__(self) -> None:
        self.told: list[tuple] = []

    def set_filter(self, filtering: bool) -> None:
        self.told.append(("filter", filtering))

    def select_pid(self, pid: int) -> None:
        self.told.append(("select", pid))

    def set_python_target(self, pid: int, target) -> None:
        self.told.append(("python", pid, target))

    def set_process_device(self, pid: int, device) -> None:
        self.told.append(("device", pid, device))

    def read_stack(self, kernel_stack_id: int):
        self.told.append(("stack", kernel_stack_id))
        return None


def test_a_process_chosen_later_turns_the_filter_on_and_is_followed_alone():
    probes = TellingProbes()
    options = BpfOptions()
    selection = Selection(probes, options)
    assert not selection.filtering and selection.follows(7)
    selection.choose(7)
    assert options.pids == {7} and selection.filtering and selection.chosen_only
    assert selection.follows(7) and not selection.follows(8)
    assert probes.told == [("filter", True), ("select", 7)]
    assert Selection(probes, BpfOptions(only_selected=True)).filtering
    # a title to match, set on a running source, filters at once (a match is looked for, not chosen)
    titled = Selection(probes, options := BpfOptions())
    options.cmdline = re.compile("vllm")
    assert titled.filtering and not titled.chosen_only and titled.cmdline is options.cmdline


def test_stack_naming_forgets_a_process_runtime_and_names_nothing_without_one():
    probes = TellingProbes()
    names = StackNames(probes, Session())
    names.add_python(7, NoPython(7, "not a Python process"))
    assert probes.told == []  # nothing for the probes to walk
    assert names.resolve(7, 99) == 0 and 99 not in names.stack_ids  # not named: tried again later
    names.forget(7)
    names.forget(8)  # never seen: nothing to tell
    assert 7 not in names.python and probes.told == [("stack", 99), ("python", 7, None)]


def test_a_process_whose_cuda_started_unseen_is_forgotten_with_its_device():
    probes = TellingProbes()
    session = Session()
    names = StackNames(probes, session)
    targets = Targets(probes, session, Discovery(), Selection(probes, BpfOptions()), names, AttachPolicy())
    targets.late_device.update({7: -1, 8: None})  # 7: device unknown (told the probes); 8: device 0
    targets.forget_cuda_start(7)
    targets.forget_cuda_start(8)
    assert targets.late_device == {} and probes.told == [("device", 7, None)]
