"""Stack naming for the BPF source: a kernel stack (the raw Python frames the probes walked) becomes an
interned, symbolized stack of the Session, once per kernel stack.

It is a part of its own because naming needs only the probes (to read a walked stack and to tell them
where a process's Python runtime is), each traced process's runtime and the symbolizer: the ring intake
names the stacks of the events it admits, the kernel's ledger those of entries whose events were lost,
and the attach targets register a runtime they found before probing its process.
"""
from __future__ import annotations

import logging

from kvtrace.model.stacks import Stack
from kvtrace.session import Session
from kvtrace.sources.bpf import abi
from kvtrace.sources.bpf.loader import BpfProbes
from kvtrace.sources.python.runtime import NoPython, PythonTarget
from kvtrace.sources.python.symbolize import Symbolizer

log = logging.getLogger(__name__)


class StackNames:
    def __init__(self, probes: BpfProbes, session: Session) -> None:
        self._probes = probes
        self._session = session
        self.python: dict[int, PythonTarget | NoPython] = {}  # per traced pid
        self.symbolizer = Symbolizer()
        self.stack_ids: dict[int, int] = {}  # kernel stack hash -> interned stack id
        self._stack_ids_by_pid: dict[int, set[int]] = {}

    def add_python(self, pid: int, found: PythonTarget | NoPython) -> None:
        """Keeps what was found of `pid`'s Python runtime; the probes walk its stacks from now."""
        self.python[pid] = found
        if isinstance(found, PythonTarget):
            o = found.offsets
            self._probes.set_python_target(pid, abi.RawPyTarget(
                tss_key_address=found.tss_key_address, tstate_frame=o.tstate_frame,
                cframe_frame=o.cframe_frame, frame_code=o.frame_code,
                frame_previous=o.frame_previous, frame_instr=o.frame_instr,
                frame_owner=o.frame_owner, frame_read_bytes=o.frame_read_bytes,
                instr_is_lasti=0 if o.instr_is_pointer else 1, tstate_datastack=o.tstate_datastack,
                interpreters_head_address=found.interpreters_head_address,
                interp_threads_head=o.interp_threads_head, tstate_prev=o.tstate_prev,
                tstate_next=o.tstate_next, tstate_thread_id=o.tstate_thread_id, tstate_interp=o.tstate_interp,
                interp_next=o.interp_next,
                tstate_base_frame=o.tstate_base_frame))

    def resolve(self, pid: int, kernel_stack_id: int) -> int:
        """Kernel stack (raw frames) -> interned, symbolized stack id; 0 if it cannot be read."""
        stack_id = self.stack_ids.get(kernel_stack_id)
        if stack_id is not None:
            return stack_id
        raw = self._probes.read_stack(kernel_stack_id)
        target = self.python.get(pid)
        if raw is None or not isinstance(target, PythonTarget):
            return 0
        frames = self.symbolizer.symbolize(
            pid, target.version, target.offsets,
            [(frame.code, frame.instr) for frame in raw.frames[:raw.depth]],
            code_type=target.code_type_address)
        stack_id = self._session.intern_stack(Stack(tuple(frames), bool(raw.truncated)))
        self.stack_ids[kernel_stack_id] = stack_id
        self._stack_ids_by_pid.setdefault(pid, set()).add(kernel_stack_id)
        return stack_id

    def forget(self, pid: int) -> None:
        """After exit or exec: its code objects, runtime and mappings are gone."""
        self.symbolizer.forget(pid)
        for kernel_stack_id in self._stack_ids_by_pid.pop(pid, ()):
            self.stack_ids.pop(kernel_stack_id, None)
        if self.python.pop(pid, None) is not None:
            self._probes.set_python_target(pid, None)

    def close(self) -> None:
        self.symbolizer.close()  # the open /proc/PID/mem files
