"""The data plane's core: schema, index, storage, samplers, rules, the in-process controller."""
