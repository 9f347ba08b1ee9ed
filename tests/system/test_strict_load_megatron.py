"""The Megatron adapter's ``strict`` (megatron-core's ``StrictHandling``): the values it honours."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core.dist_checkpointing.mapping",
                    reason="megatron-core is not installed (pip install 'nostall[megatron]')")


def test_megatron_strict_handling(tmp_path):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.validation import StrictHandling

    import nostall
    from nostall.interop import megatron

    root = str(tmp_path / "ck")
    megatron.save({"t": ShardedTensor.from_rank_offsets("t", torch.arange(4.0)),
                   "u": ShardedTensor.from_rank_offsets("u", torch.ones(2))}, root)
    for strict in (None, StrictHandling.ASSUME_OK_UNEXPECTED, StrictHandling.RAISE_UNEXPECTED, "raise_unexpected"):
        # a checkpoint key the template lacks ("u"; Megatron's "missing") is not loaded and no error
        out = megatron.load({"t": ShardedTensor.from_rank_offsets("t", torch.zeros(4))}, root, strict=strict)
        assert torch.equal(out["t"], torch.arange(4.0)) and "u" not in out
        # a template key the checkpoint lacks (Megatron's "unexpected") is an error
        with pytest.raises(nostall.CheckpointLoadError, match="'gone': not in the checkpoint"):
            megatron.load({"g": ShardedTensor.from_rank_offsets("gone", torch.zeros(4))}, root, strict=strict)
    for strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.RAISE_ALL, StrictHandling.RETURN_ALL,
                   StrictHandling.IGNORE_ALL):
        with pytest.raises(ValueError, match="is not supported"):
            megatron.load({"t": ShardedTensor.from_rank_offsets("t", torch.zeros(4))}, root, strict=strict)
