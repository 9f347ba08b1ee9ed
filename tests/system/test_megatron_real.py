"""Megatron-core adapter on REAL megatron-core models (issue 17).

A tiny ``GPTModel`` (learned positions, biases, tied embeddings) and a tiny
Llama-style one (SwiGLU, RMSNorm, grouped-query attention, no bias, untied
output layer), built on CPU with the local layer spec (no Transformer
Engine) in gloo process groups, saved through the adapter at one
tensor-parallel degree and loaded at another.

Every weight is checked exactly. The reference is a model whose weights are
known (each parameter filled from a seed of its name and, when TP-sharded,
its TP rank); :func:`_split` states, independently of the adapter, how
Megatron splits each global weight over TP ranks (fused QKV: query groups
are contiguous rows; SwiGLU fc1: ``[gate; up]`` with each rank holding its
rows of both; row-parallel layers: columns). A TP=1 model's parameters ARE
the global weights, so "loaded at TP=2" is checked as
``local == _split(global)`` and "loaded at TP=1" as
``_split(loaded) == the TP=2 original``. Then the loaded model is saved again
and loaded back at the first degree, bit-exact against the original.

Megatron's own ``dist_checkpointing.save`` (``torch_dist``) needs CUDA, a
multiprocessing Manager and forked writer processes: on CPU it runs with
``torch.cuda.synchronize`` / ``current_device`` patched, and in two plain
(non-daemonic) rank processes started here, since the harness's ranks are
daemonic and may not have children.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zlib

import pytest
import torch

pytest.importorskip("megatron.core.models.gpt",
                    reason="megatron-core is not installed (pip install 'nostall[megatron]')")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository (tests/system/..)

KINDS = ("gpt", "llama")


# --------------------------------------------------------------------------- models (run in the ranks)


def _quiet() -> None:
    import warnings

    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
    warnings.filterwarnings("ignore", message=".*Apex.*")


def _init_tp(tp: int) -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)


def _done() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def _config(kind: str):
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    common = dict(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                  hidden_dropout=0.0, attention_dropout=0.0)
    if kind == "gpt":
        return TransformerConfig(**common, ffn_hidden_size=64)
    return TransformerConfig(**common, ffn_hidden_size=48, gated_linear_unit=True, activation_func=F.silu,
                             normalization="RMSNorm", num_query_groups=2, add_bias_linear=False)


def _model(kind: str, tp: int, seed: int):
    """A tiny GPT ('gpt': tied embeddings, biases, LayerNorm) or Llama-style model ('llama')
    at tensor-parallel degree ``tp`` (model parallel state initialised here), every
    parameter filled from ``seed``, its name and (if TP-sharded) its TP rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    _quiet()
    _init_tp(tp)
    cfg = _config(kind)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm" if kind == "llama" else "LayerNorm")
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=128, max_sequence_length=16,
                     share_embeddings_and_output_weights=(kind == "gpt"),
                     position_embedding_type="rope" if kind == "llama" else "learned_absolute")
    tp_rank = ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            sharded = bool(getattr(p, "tensor_model_parallel", False))
            g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}/{tp_rank if sharded else -1}".encode()))
            p.copy_(torch.randn(p.shape, generator=g))
    return model


def _params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _split(kind: str, name: str, full: torch.Tensor, tp: int, r: int) -> torch.Tensor:
    """TP rank ``r``'s part of the global weight ``full`` of parameter ``name``: how Megatron
    shards it (stated here, independently of the adapter)."""
    last = name.rsplit(".", 2)[-2:]
    module, what = last[0], last[1]
    if module in ("word_embeddings", "output_layer", "linear_qkv"):
        # vocab-parallel rows; fused QKV: [q heads, k, v] per query group, groups contiguous
        return full.chunk(tp)[r]
    if module == "linear_fc1":
        if kind == "llama":  # SwiGLU: [gate; up], each rank holds its rows of both
            gate, up = full.chunk(2)
            return torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]])
        return full.chunk(tp)[r]
    if module in ("linear_proj", "linear_fc2"):  # row-parallel: the weight's columns; bias replicated
        return full.chunk(tp, dim=1)[r] if what == "weight" else full
    return full  # norms, position embeddings: replicated


# --------------------------------------------------------------------------- jobs (pool ranks)


def _reshard_job(rank, world, kind, a, b, root):
    """Save at TP=a, load at TP=b (every weight checked against the known TP=a model in
    global coordinates), save at TP=b, load back at TP=a: bit-exact."""
    from megatron.core import parallel_state as ps

    from nostall.interop import megatron as dist_checkpointing

    try:
        m = _model(kind, a, seed=1)
        orig = _params(m)
        ra = ps.get_tensor_model_parallel_rank()
        dist_checkpointing.save(m.sharded_state_dict(), os.path.join(root, "a"))
        del m

        m = _model(kind, b, seed=2)  # other values everywhere
        rb = ps.get_tensor_model_parallel_rank()
        before = _params(m)
        state = dist_checkpointing.load(m.sharded_state_dict(), os.path.join(root, "a"))
        m.load_state_dict(state)
        got = _params(m)
        assert sorted(got) == sorted(orig)
        checked = []
        for name, t in got.items():
            assert not torch.equal(t, before[name]), name  # really overwritten
            if a == 1:  # the TP=1 original holds the global weights
                want = _split(kind, name, orig[name], b, rb)
                assert torch.equal(t, want), (name, rb)
            else:  # b == 1: the loaded model holds them; the TP=a original is its split
                assert torch.equal(_split(kind, name, t, a, ra), orig[name]), (name, ra)
            checked.append(name)
        dist_checkpointing.save(m.sharded_state_dict(), os.path.join(root, "b"))
        del m

        m = _model(kind, a, seed=3)
        state = dist_checkpointing.load(m.sharded_state_dict(), os.path.join(root, "b"))
        m.load_state_dict(state)
        for name, t in _params(m).items():
            assert torch.equal(t, orig[name]), (name, "round trip")
        return sorted(checked)
    finally:
        _done()


def _swiglu_job(rank, world, root):
    """The smallest reproduction of the SwiGLU defect: TP=1 save, TP=2 load."""
    from nostall.interop import megatron as dist_checkpointing

    try:
        m = _model("llama", 1, seed=1)
        fc1 = m.decoder.layers[0].mlp.linear_fc1.weight.detach().clone()
        dist_checkpointing.save(m.sharded_state_dict(), root)
        m = _model("llama", 2, seed=2)
        state = dist_checkpointing.load(m.sharded_state_dict(), root)
        m.load_state_dict(state)
        got = m.decoder.layers[0].mlp.linear_fc1.weight.detach()
        return torch.equal(got, _split("llama", "decoder.layers.0.mlp.linear_fc1.weight", fc1, 2, rank))
    finally:
        _done()


# --------------------------------------------------------------------------- tests


def test_swiglu_tp1_saved_loads_at_tp2(tmp_path, pool2):
    """A SwiGLU model saved at TP=1 loads at TP=2 (the factory's views are filled without
    autograd's view/in-place error)."""
    assert pool2.run(_swiglu_job, str(tmp_path / "ck")) == [True, True]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("a,b", [(1, 2), (2, 1)])
def test_real_model_reshard(tmp_path, pool2, kind, a, b):
    checked = pool2.run(_reshard_job, kind, a, b, str(tmp_path))
    assert checked[0] == checked[1]
    names = checked[0]
    if kind == "gpt":
        assert "embedding.position_embeddings.weight" in names
        assert not any(n.startswith("output_layer") for n in names)  # tied to the embedding
        assert "decoder.layers.1.self_attention.linear_qkv.bias" in names
    else:
        assert "output_layer.weight" in names
        assert not any(n.endswith("bias") for n in names)
    assert "decoder.layers.1.mlp.linear_fc1.weight" in names and "decoder.final_layernorm.weight" in names


# --------------------------------------------------------------------------- Megatron's own torch_dist save


def _launched() -> None:
    """Entry point of a rank started by :func:`_launch` (a plain, non-daemonic process)."""
    import pickle

    import torch.distributed as dist

    rank, world, tmp = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    with open(os.path.join(tmp, "job.pkl"), "rb") as f:
        fn, args = pickle.load(f)  # written by the test itself
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=rank,
                            world_size=world)
    try:
        value = fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(tmp, f"result{rank}.json"), "w") as f:
        json.dump(value, f)


def _launch(world: int, fn, *args, timeout: float = 240.0) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks in plain child processes (which,
    unlike the harness's daemonic ranks, may start processes of their own, as Megatron's
    writer does). Returns the JSON results by rank; raises with every rank's output."""
    import pickle
    import shutil
    import signal

    tmp = tempfile.mkdtemp(prefix="nostall-mg-")
    procs = []
    try:
        with open(os.path.join(tmp, "job.pkl"), "wb") as f:
            pickle.dump((fn, args), f)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        code = "from tests.system.test_megatron_real import _launched; _launched()"
        for r in range(world):
            log = open(os.path.join(tmp, f"log{r}"), "w")
            procs.append(subprocess.Popen([sys.executable, "-c", code, str(r), str(world), tmp], cwd=ROOT, env=env,
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
        failed = False
        for p in procs:
            try:
                failed |= p.wait(timeout=timeout) != 0
            except subprocess.TimeoutExpired:
                failed = True
                break
        if failed:
            for p in procs:  # each rank and whatever it started (its own session)
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            logs = "\n".join(f"--- rank {r} ---\n" + open(os.path.join(tmp, f"log{r}")).read()[-6000:]
                             for r in range(world))
            raise AssertionError(f"ranks failed or timed out:\n{logs}")
        return [json.load(open(os.path.join(tmp, f"result{r}.json"))) for r in range(world)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _torch_dist_job(rank, world, root):
    """Megatron's own save (torch_dist) at TP=2, ``nostall convert --from dcp``, loads through
    the adapter at TP=2 and TP=1, every weight checked."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing as megatron_dist_checkpointing
    from megatron.core import parallel_state as ps

    from nostall.tools.cli import main as cli_main
    from nostall.interop import megatron as dist_checkpointing

    checked = {}
    try:
        for kind in KINDS:
            td, imported = os.path.join(root, kind, "torch_dist"), os.path.join(root, kind, "imported")
            m = _model(kind, 2, seed=1)
            orig = _params(m)
            tp_rank = ps.get_tensor_model_parallel_rank()
            if rank == 0:
                os.makedirs(td)
            dist.barrier()
            # Megatron's writer is CUDA-only in two places; on CPU they have nothing to do
            saved = torch.cuda.synchronize, torch.cuda.current_device
            torch.cuda.synchronize, torch.cuda.current_device = (lambda *a, **k: None), (lambda: "cpu")
            try:
                megatron_dist_checkpointing.save(m.sharded_state_dict(), td)
            finally:
                torch.cuda.synchronize, torch.cuda.current_device = saved
            if rank == 0:
                assert cli_main(["convert", "--from", "dcp", td, imported]) == 0
            dist.barrier()

            m = _model(kind, 2, seed=2)
            sd = m.sharded_state_dict()
            objects = [k for k, v in sd.items() if type(v).__name__ == "ShardedObject"]
            assert objects  # every real GPTModel has _extra_state objects
            state = dist_checkpointing.load(sd, imported)
            m.load_state_dict(state)
            for name, t in _params(m).items():
                assert torch.equal(t, orig[name]), (kind, name, "TP=2")

            m = _model(kind, 1, seed=3)
            state = dist_checkpointing.load(m.sharded_state_dict(), imported)
            m.load_state_dict(state)
            got = _params(m)
            for name, want in orig.items():
                assert torch.equal(_split(kind, name, got[name], 2, tp_rank), want), (kind, name, "TP=1")
            checked[kind] = sorted(got)
        return checked
    finally:
        _done()


def test_megatron_torch_dist_save_imported_loads(tmp_path):
    """A checkpoint written by Megatron's own dist_checkpointing.save (torch_dist) and imported
    with `nostall convert --from dcp` loads through the adapter, its ShardedObjects included."""
    pytest.importorskip("psutil", reason="Megatron's torch_dist writer needs psutil")
    out = _launch(2, _torch_dist_job, str(tmp_path))
    assert out[0] == out[1]
    assert "decoder.layers.1.mlp.linear_fc1.weight" in out[0]["llama"]
    assert "embedding.position_embeddings.weight" in out[0]["gpt"]


# --------------------------------------------------------------------------- distributed optimizer


def _distributed_optimizer_job(rank, world):
    """Try to build Megatron's DistributedOptimizer on CPU; where it fails (file:line)."""
    import traceback

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    try:
        m = _model("llama", 1, seed=1)
        try:
            ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True)
            ddp = DistributedDataParallel(_config("llama"), ddp_config, m)
            get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True), [ddp],
                                   use_gloo_process_groups=False)
        except Exception as e:
            frames = [f for f in traceback.extract_tb(e.__traceback__) if "megatron" in f.filename]
            where = f"{frames[-1].filename.split('site-packages/')[-1]}:{frames[-1].lineno}" if frames else "?"
            return f"{type(e).__name__}: {e} (at {where})"
        return None
    finally:
        _done()


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="megatron-core 0.16's DistributedOptimizer cannot be built on CPU (it allocates its "
                          "buffers on CUDA); once it builds, this strict xfail fails: write the real round trip")
def test_distributed_optimizer_on_cpu(pool2):
    """Megatron's distributed optimizer state through the adapter needs a DistributedOptimizer,
    which megatron-core 0.16 cannot build on CPU: DistributedDataParallel allocates its
    param/grad buffers on torch.cuda.current_device() (distributed/param_and_grad_buffer.py),
    MixedPrecisionOptimizer.__init__ makes tensors on device='cuda' (optimizer/optimizer.py),
    and DistributedOptimizer accepts only torch.cuda.*Tensor parameters (TypeError otherwise,
    optimizer/distrib_optimizer.py). The adapter's flattened-range layout (megatron-core
    <= 0.15's optimizer format) is covered by tests/test_interop_megatron.py. This test is
    an expected failure (strict): once the optimizer builds here, it passes, which fails the
    run, so that the real round trip gets written then. Any other error is a real failure."""
    errors = pool2.run(_distributed_optimizer_job)
    assert errors[0] is None, f"megatron-core's DistributedOptimizer cannot be built on CPU: {errors[0]}"
