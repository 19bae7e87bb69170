"""How weights reach rollout: the host-memory store, the publisher and the subscriber."""
