"""Algorithm library: advantage estimators, policy losses, KL estimators, off-policy corrections.

One file per concern (``advantages``, ``losses``, ``kl``, ``corrections``); ``algorithm``
binds them to a config for the actor.
"""
