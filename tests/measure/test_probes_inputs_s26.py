"""The probes' default loss and token count on what tokenizers and collators hand over: a ``BatchEncoding`` (a
Mapping, not a dict: it was passed positionally and crashed inside transformers, and counted in samples/s), a padded
batch (its padding was counted as tokens), an ``(x, y)`` pair (a TypeError from inside the model)."""

from __future__ import annotations

from collections import UserDict

import pytest
import torch

from microbatch.errors import ConfigError
from microbatch.measure.probes import _tokens_in, default_loss


class Encoding(UserDict):  # what transformers' BatchEncoding is: a UserDict, a Mapping, not a dict
    pass


def test_a_mapping_that_is_not_a_dict_is_read_as_keyword_arguments():
    seen = {}

    def model(input_ids=None, labels=None):
        seen["ids"] = input_ids
        return {"loss": input_ids.float().mean()}

    batch = Encoding(input_ids=torch.ones(2, 3, dtype=torch.long))
    assert float(default_loss(model, batch)) == 1.0 and seen["ids"].shape == (2, 3)
    assert _tokens_in(batch) == 6


def test_padding_is_not_counted_as_tokens():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert _tokens_in({"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": mask}) == 4
    assert _tokens_in({"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": mask.bool()}) == 4
    assert _tokens_in({"input_ids": torch.ones(2, 4, dtype=torch.long)}) == 8
    zeros = torch.zeros(2, 4, dtype=torch.long)  # no ones at all: the padded count, never 0 tokens/s
    assert _tokens_in({"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": zeros}) == 8
    assert _tokens_in({"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": mask[:, :3]}) == 8


def test_a_dict_of_logits_is_read_and_a_pair_asks_for_a_loss_fn():
    ids = torch.randint(0, 5, (2, 3))
    logits = torch.randn(2, 3, 5)
    loss = default_loss(lambda input_ids: {"logits": logits}, {"input_ids": ids})
    assert loss.dim() == 0 and torch.isfinite(loss)
    linear = torch.nn.Linear(4, 2)
    with pytest.raises(ConfigError, match=r"tuple of 2.*loss_fn=lambda model, batch"):
        default_loss(linear, (torch.randn(3, 4), torch.tensor([0, 1, 0])))
