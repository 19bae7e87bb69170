"""The columns of the RL sample table and the row kinds that live in it.

Each training step owns one partition (its index). Two kinds of rows share the table:

* prompt rows, put by the driver: ``query_ids``, ``answer``, ``gen_len``, (multi-turn) ``prompt``, ``prompt_id`` (the
  prompt's stable id, ``source partition * prompts_per_step + index``: the same across a
  resume, when row ids are not);
* sample rows, put by rollout (one per answer): ``prompt_ids``, ``response_ids``,
  ``logprobs`` (behaviour policy), ``token_versions`` (the policy version that sampled each
  token), ``answer``, ``group`` (the prompt's ``prompt_id``; the prompt row id
  when rollout runs without one), ``version``
  (policy version that started the answer); then ``reward`` (reward role) and
  ``ref_logprobs`` (reference role) and, for PPO, ``advantages`` (critic role: per-token
  GAE advantages). A multi-turn sample (:mod:`asyncflow.agents`) also has ``loss_mask``
  (per response token: 1 generated, 0 an observation the trainer must not learn).

Rows also carry tags ``group``, ``version`` and ``tokens`` for the samplers.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from asyncflow.dataplane import Field, Schema

SCHEMA = Schema([
    Field("query_ids", "int64", ragged=True),
    Field("prompt", "uint8", ragged=True),  # utf-8 bytes of the prompt's text (multi-turn: the env's reset)
    Field("gen_len", "int64"),
    Field("answer", "uint8", ragged=True),  # utf-8 bytes of the ground truth
    Field("prompt_ids", "int64", ragged=True),
    Field("response_ids", "int64", ragged=True),
    Field("logprobs", "float32", ragged=True),
    Field("token_versions", "int64", ragged=True),
    Field("prompt_id", "int64"),
    Field("group", "int64"),
    Field("version", "int64"),
    Field("reward", "float32"),
    Field("ref_logprobs", "float32", ragged=True),
    Field("advantages", "float32", ragged=True),
    Field("loss_mask", "uint8", ragged=True),
])


def encode_text(s: str) -> np.ndarray:
    return np.frombuffer(s.encode("utf-8"), dtype=np.uint8).copy()


def decode_text(a: Iterable[int]) -> str:
    return bytes(bytearray(a)).decode("utf-8")
