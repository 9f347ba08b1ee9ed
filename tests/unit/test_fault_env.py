"""A malformed NOSTALL_TEST_CRASH is refused where a manager starts, not mid-save (nostall.core.faults)."""

from __future__ import annotations

import pytest
import torch

import nostall
from nostall.core import faults


@pytest.mark.parametrize("spec", ["trainer:staged", "trainer:staged:two", "nobody:staged:2", "writer:nowhere:1",
                                  "trainer:staged:2:extra", "trainer:staged:-1"])
def test_a_malformed_crash_spec_is_refused_when_a_manager_starts(tmp_path, monkeypatch, spec):
    monkeypatch.setenv(faults.ENV, spec)
    with pytest.raises(ValueError, match=faults.ENV):
        nostall.CheckpointManager(tmp_path)
    assert not (tmp_path / "step_1").exists()


@pytest.mark.parametrize("spec", ["trainer:staged:2", "writer:write.done:1", "trainer:commit.renamed:None"])
def test_a_well_formed_crash_spec_that_is_not_reached_changes_nothing(tmp_path, monkeypatch, spec):
    monkeypatch.setenv(faults.ENV, spec)
    with nostall.CheckpointManager(tmp_path) as mgr:
        mgr.save(7, {"w": torch.ones(3)})  # step 7: no armed point is reached
        assert mgr.steps() == [7]
