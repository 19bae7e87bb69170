"""Engines: the built-in inference and training engines on Hugging Face causal LMs, and the
adapters of external ones (vLLM, SGLang), which import their engine only when built.

* :mod:`~asyncflow.engines.types`       the inference engine protocol and its records (no torch)
* :mod:`~asyncflow.engines.inference`   built-in engine: continuous batching on slots (``slot_batch``, ``slot_pool``,
  ``slot_step``, ``slot_cache``, ``slot_graphs``: a preallocated KV cache, the decode step on the device,
  CUDA graphs); ``reference``: the former right-aligned ``DynamicCache`` path it is tested against
* :mod:`~asyncflow.engines.training`    built-in trainer: log-probs, micro-batched steps, LR schedule
* :mod:`~asyncflow.engines.critic`      PPO's value model and its optimizer
* :mod:`~asyncflow.engines.collective`  a data-parallel trainer's collectives (threads or torch.distributed)
* :mod:`~asyncflow.engines.adapters`, :mod:`~asyncflow.engines.vllm_engine`, :mod:`~asyncflow.engines.sglang_engine`
* :mod:`~asyncflow.engines.fake`        a deterministic fake inference engine for tests
* :mod:`~asyncflow.engines.tiny`        the built-in tiny model and tokenizer, built in code
* :mod:`~asyncflow.engines.device`, :mod:`~asyncflow.engines.allocator`   where and how engines compute
"""
