"""AsyncFlow: asynchronous streaming RL post-training for LLMs.

Layers, lowest first; a package imports only from its own layer or below
(``tests/test_layers.py`` checks it; ``docs/architecture.md`` explains it):

0. ``config``      typed configuration, validated at load (no torch)
1. ``dataplane``   the streaming data plane: ``core`` (schema, index, storage, samplers,
   rules, the in-process controller) and ``transport`` (ZeroMQ, shared memory)
   ``weights``     how weights reach rollout: host-memory store, subscriber
   ``algorithms``  advantage estimators, policy losses, KL, off-policy corrections
   ``observe``     progress, metrics, summaries, timeline traces
2. ``engines``     inference and training engines (built-in torch/HF; vLLM, SGLang adapters)
3. ``tasks``       built-in tasks, a user's task by import path, rewards, the SFT warm-start
4. ``workflow``    roles, the worker plan, the job and the driver loop
5. ``launch``      the in-process and Ray launchers (the only place Ray is imported)
6. ``bench``       sync vs stream vs async against their bounds
7. ``planner``     execution-time simulation, profiling, ``plan=auto``
8. ``api``         ``train(cfg)``: the public entry point
9. ``cli``         the ``asyncflow`` command
"""

__version__ = "0.1.0"
