"""Interoperability with other checkpoint systems.

* :mod:`nostall.interop.megatron` -- save and load a Megatron-core
  ``sharded_state_dict`` (ShardedTensor, ShardedObject, factories) with nostall;
* :mod:`nostall.interop.dcp` -- a ``torch.distributed.checkpoint`` StorageReader
  over nostall checkpoints, and import of DCP (and Megatron ``torch_dist``)
  checkpoints into the nostall format;
* :mod:`nostall.interop.export` -- export to Hugging Face style safetensors
  files or one ``torch.save`` file, with bounded memory.

Nothing is imported here: each module is imported on use (megatron-core is an
optional dependency, extra ``megatron``). See ``docs/interop.md``.
"""
