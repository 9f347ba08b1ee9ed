"""A save's stats: provisional while an asynchronous save is in flight, final once it committed,
and the final figures agree with what the commit callback saw and with the files on disk."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Dict, List

import torch

import nostall

FROZEN = 256 * 1024  # elements of the frozen tensor: 1 MiB, written once
CHANGED = 1024  # elements of the tensor every save changes


def _state(step: int) -> Dict[str, torch.Tensor]:
    return {"frozen": torch.arange(FROZEN, dtype=torch.float32), "adapter": torch.full((CHANGED,), float(step))}


def _data_files(ckpt: Path) -> Dict[str, int]:
    return {p.name: p.stat().st_size for p in ckpt.glob("*.safetensors")}


def test_async_incremental_stats_are_provisional_then_final(tmp_path: Path) -> None:
    seen: Dict[int, nostall.SaveStats] = {}
    ready = threading.Event()

    def on_commit(handle: nostall.SaveHandle) -> None:
        ready.wait(30)  # committed, but the test looks at the handle in flight first
        assert handle.stats is not None
        seen[handle.step] = handle.stats

    mgr = nostall.CheckpointManager(tmp_path, async_save=True, incremental=True, keep_last=None,
                                    on_commit=on_commit)
    try:
        provisional: List[nostall.SaveStats] = []
        finals: List[nostall.SaveStats] = []
        for step in (1, 2):
            ready.clear()
            handle = mgr.save(step, _state(step))
            st = handle.stats
            assert st is not None
            provisional.append(st)
            ready.set()
            finals.append(handle.result())
            assert handle.stats is finals[-1]
        mgr.finalize_pending_saves()
    finally:
        mgr.close()

    for st, fin in zip(provisional, finals):
        # provisional: what is written and the write/commit times are not known yet
        assert st.final is False and st.committed is False
        assert st.bytes_written is None and st.write_s is None and st.commit_s is None and st.total_s is None
        assert st.write_throughput == 0.0
        # final: every figure known, and the fields known at once kept their values
        assert fin.final is True and fin.committed is True
        assert fin.bytes_written is not None and fin.write_s is not None and fin.total_s is not None
        assert (fin.step, fin.plan_s, fin.wait_s, fin.stall_s, fin.stage_s, fin.total_bytes) == \
            (st.step, st.plan_s, st.wait_s, st.stall_s, st.stage_s, st.total_bytes)
        assert seen[fin.step] == fin  # what the commit callback saw

    full = _data_files(tmp_path / "step_1")
    new = {name: size for name, size in _data_files(tmp_path / "step_2").items() if name not in full}
    assert finals[0].bytes_written == sum(full.values()) == finals[0].total_bytes
    # the incremental save wrote only the changed piece: its new data files, nothing like the full size
    assert finals[1].bytes_written == sum(new.values())
    assert 0 < finals[1].bytes_written < finals[1].total_bytes // 10
    assert finals[1].total_bytes == finals[0].total_bytes


def test_sync_stats_are_final_at_once(tmp_path: Path) -> None:
    with nostall.CheckpointManager(tmp_path) as mgr:
        handle = mgr.save(1, _state(1))
        st = handle.stats
    assert st is not None and st.final and st.bytes_written == sum(_data_files(tmp_path / "step_1").values())
