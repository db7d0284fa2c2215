"""twinkle-kit, megatron-core and mcore_bridge run on a CPU, for the tests and the benchmarks (it
does not ship: the wheel holds only python/twinkle_mem).

- ``megatron``: a gloo world of one process with Megatron's parallel state, the CPU stand-ins every
  run of twinkle's Megatron path needs, a toy LM that tracks its logits, megatron-core GPT and transformers models
  wrapped by twinkle's real ``MegatronModel`` / ``TransformersModel``, and samples.
- ``mcore_bridge``: twinkle's ``MegatronModel(model_id=...)`` built through mcore_bridge from a local
  tiny Qwen3, with each stand-in it needs on the CPU named and justified.
- ``memory``: the peak resident memory and time of a statement in a fresh interpreter, and the large
  allocations torch's profiler sees in this one.
- ``megatron_lora``: training that model with a LoRA adapter, megatron-core's optimizer and mcore_bridge's
  export (twinkle's ``add_adapter_to_model``, ``set_optimizer('default')``, ``save``): stand-ins 13-19.
- ``twinkle_ray``: twinkle's Ray mode with model workers on the CPU (the stand-ins entered in each worker by
  Ray's setup hook); ``recipes``: twinkle-kit's Megatron recipes run in it, with stand-ins for the vLLM sampler
  and teacher; ``recipe_reference``: their first steps in bf16 against float64.

tests/ gets it on ``sys.path`` from pytest (``pythonpath`` in pyproject.toml), bench/ from
``bench_common``.
"""
