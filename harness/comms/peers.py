"""Who is behind a failed collective: the ranks of a group, their processes, and what a failure means.

gloo reports a dead peer as "Connection reset by peer [127.0.0.1]:PORT" and a hung one as a timeout:
neither names a rank. So each rank of a shaped group leaves its host and process id in the group's
store when the group is made (one ``set``, nothing on the collective path), and a failed collective
looks them up: a peer whose process is gone (or a zombie) on this host is named as dead. A store that
no longer answers is named too (a ``TCPStore`` lives in rank 0's process unless torchrun's agent holds
it). The error is a `torch.distributed.DistBackendError`, what NCCL raises for a broken communicator.

A mismatch (ranks calling different collectives, or one collective with different sizes) is caught
before any message moves, when the check is on (`check_plan`): gloo itself aborts the process of a
rank that receives more bytes than it expected.

This module depends only on torch.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

_KEY = "portharness/peer/{}"
SETTLE_S = 2.0  # how long a broken connection waits for the peer that is dying to be gone, before saying none died
_BROKEN = re.compile(r"connection|closed|reset|broken pipe", re.IGNORECASE)
# dtype codes for the mismatch check (any stable numbering does: every rank runs the same torch)
_DTYPES = {d: i for i, d in enumerate(sorted({getattr(torch, n) for n in dir(torch)
                                              if isinstance(getattr(torch, n), torch.dtype)}, key=str))}
_NAMES = {i: str(d).removeprefix("torch.") for d, i in _DTYPES.items()}


def _state(pid: int) -> str:
    """'alive', 'dead' or 'zombie' for a process of this host."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return "zombie" if fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X") else "alive"
    except FileNotFoundError:
        return "dead"
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "dead"
    except PermissionError:
        pass
    return "alive"


class Peers:
    """The processes of a group's ranks, registered in its store, for naming a failed collective's cause."""

    def __init__(self, store: dist.Store, rank: int, members: Sequence[int], label: str) -> None:
        self._store = store
        self.rank = rank
        self.members = tuple(members)
        self.label = label
        self._host = socket.gethostname()
        store.set(_KEY.format(rank), f"{self._host} {os.getpid()}")

    def name(self, group_rank: int) -> str:
        g = self.members[group_rank]
        return f"rank {g}" if g == group_rank else f"rank {g} (group rank {group_rank})"

    def lost(self) -> tuple[list[str], str]:
        """The peers whose process is gone, each in words; and a note when the store itself is gone."""
        out: list[str] = []
        for r in range(len(self.members)):
            if r == self.rank:
                continue
            key = _KEY.format(r)
            try:
                if not self._store.check([key]):
                    out.append(f"{self.name(r)} never joined the group")
                    continue
                host, pid = self._store.get(key).decode().split()
            except Exception as exc:  # noqa: BLE001  the store's process may be the one that died
                return out, f"the group's store does not answer ({type(exc).__name__}: {exc}); its host process is gone"
            if host == self._host:
                state = _state(int(pid))
                if state != "alive":
                    out.append(f"{self.name(r)} (pid {pid}) is dead")  # gone, or a zombie its parent has not reaped
        return out, ""

    def explain(self, op: str, exc: BaseException) -> dist.DistBackendError:
        """`exc` (the transport's error) as an error that says which peer failed, when that is known."""
        lost, store_note = self.lost()
        deadline = time.monotonic() + (SETTLE_S if _BROKEN.search(str(exc)) else 0.0)
        while not lost and not store_note and time.monotonic() < deadline:
            time.sleep(0.05)  # a killed peer's sockets close before its process is gone: let it finish dying
            lost, store_note = self.lost()
        if lost:
            cause = "; ".join(lost)
        elif store_note:
            cause = store_note
        else:
            cause = "no peer process died: one is late or hung, or the ranks called different collectives"
        # The cause first, and this process by its pid alone: readers (and the fault bench's watchdog) take the
        # first rank an error names for the one at fault.
        return dist.DistBackendError(f"{cause}: {op} failed in {self.label} of {len(self.members)} ranks "
                                     f"(here: pid {os.getpid()}). Transport error: {exc}")


FP_TENSORS = 7  # tensors whose size and dtype a fingerprint lists one by one (then a count and a total)


def fingerprint(op_code: int, tensors: Sequence[torch.Tensor], world: int,
                splits: tuple[Sequence[int], Sequence[int]] | None = None) -> torch.Tensor:
    """What the ranks must agree on for one collective, as one int64 row of a fixed length per group: the
    op, the tensor count and total size, each tensor's size and dtype; for an all_to_all with splits, this
    rank's input and output splits (each input split must equal the output split its peer expects)."""
    fp = [op_code, len(tensors), sum(t.numel() for t in tensors)]
    for t in tensors[:FP_TENSORS]:
        fp += [t.numel(), _DTYPES.get(t.dtype, -1)]
    fp += [-1] * (3 + 2 * FP_TENSORS - len(fp))
    ins, outs = splits if splits is not None else ([-1] * world, [-1] * world)
    return torch.tensor(fp + list(ins) + list(outs), dtype=torch.int64)


def describe(ops: Sequence[str], row: Sequence[int]) -> str:
    """One rank's fingerprint in words: ``all_reduce(4 x float32)``."""
    n = row[1]
    parts = [f"{row[3 + 2 * i]} x {_NAMES.get(row[4 + 2 * i], '?')}" for i in range(min(n, FP_TENSORS))]
    if n > FP_TENSORS:
        parts.append(f"... {n} tensors, {row[2]} elements")
    return f"{ops[row[0]] if 0 <= row[0] < len(ops) else '?'}({', '.join(parts)})"


def mismatch(ops: Sequence[str], rows: Sequence[Sequence[int]], peers: Peers) -> str:
    """'' when every rank's fingerprint agrees, else which ranks disagree and how."""
    world = len(rows)
    head = 3 + 2 * FP_TENSORS
    mine = rows[peers.rank]
    for r, row in enumerate(rows):
        if row[0] != mine[0] or (row[:head] != mine[:head] and row[head] == -1):
            return (f"{peers.name(peers.rank)} called {describe(ops, mine)} but {peers.name(r)} called "
                    f"{describe(ops, row)}: every rank of a group must make the same collectives, in the same "
                    "order, with the same sizes and dtypes")
    if mine[head] != -1:  # all_to_all with splits: what i sends j is what j expects from i
        for i in range(world):
            for j in range(world):
                sent, expected = rows[i][head + j], rows[j][head + world + i]
                if sent != expected:
                    return (f"{ops[mine[0]]}: {peers.name(i)} sends {sent} rows to {peers.name(j)}, which expects "
                            f"{expected}: input and output splits must match across ranks")
    return ""
