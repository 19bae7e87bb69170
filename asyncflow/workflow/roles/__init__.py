"""The roles: plain classes with a poll loop (rollout, reward, reference, actor, critic)."""
