"""AsyncFlow: asynchronous streaming RL post-training for LLMs.

Layers (one folder per concern):

* ``asyncflow.queue``      streaming data plane (sample x field table, controller, samplers)
* ``asyncflow.workflow``   roles, staleness bound, delayed parameter update, the driver loop
* ``asyncflow.engines``    inference and training engines (built-in torch/HF), weight store
* ``asyncflow.algorithms`` advantages and losses (GRPO)
* ``asyncflow.tasks``      built-in tasks, rewards, SFT warm-start
* ``asyncflow.launch``     in-process and Ray launchers (the only place Ray is imported)
* ``asyncflow.observe``    metrics, progress, summaries
"""

__version__ = "0.1.0"
