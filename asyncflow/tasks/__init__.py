"""Tasks: what the model is asked, how an answer is scored, and the model it starts from.

* :mod:`~asyncflow.tasks.registry`     task names -> factories; a user's task by import path
* :mod:`~asyncflow.tasks.base`         the :class:`Task` and :class:`TaskReward` protocols
* :mod:`~asyncflow.tasks.addition`, :mod:`~asyncflow.tasks.arith_tasks`   built-in tasks
* :mod:`~asyncflow.tasks.dataset_task` ``task.name=dataset`` (:mod:`~asyncflow.tasks.datasets` reads the file)
* :mod:`~asyncflow.tasks.rewards`      ``reward.fn``: a user's reward function, timed out and counted
* :mod:`~asyncflow.tasks.models`       the initial policy (a model folder, or the warm-started tiny model)
* :mod:`~asyncflow.tasks.warmstart`    the SFT warm-start and the held-out evaluation
"""
