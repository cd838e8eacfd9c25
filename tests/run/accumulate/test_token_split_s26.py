"""split_by_tokens cuts only what is padding: an encoder-decoder's labels longer than the inputs' rows kept whole, a
row's float features and a spectrogram's mel bins never taken for the padded width, the cut copied contiguous (a
Hugging Face head's ``labels.view(-1)`` failed on the strided view)."""

from __future__ import annotations

import torch

from microbatch.run.accumulate.microbatches import split_by_tokens

LENS = [2, 3, 8, 4]


def _mask(width=8):
    return (torch.arange(width)[None] < torch.tensor(LENS)[:, None]).long()


def test_labels_longer_than_the_inputs_are_not_cut():
    mask = _mask()
    labels = torch.full((4, 8), -100)
    labels[:, :7] = 5  # targets of 7 tokens behind inputs of 2..8: real tokens past the inputs' longest row
    batch = {"input_ids": (mask * 9), "attention_mask": mask, "labels": labels}
    pieces = split_by_tokens(batch, 8, lengths=mask.sum(1))
    assert [tuple(p["input_ids"].shape) for p in pieces] == [(2, 3), (1, 8), (1, 4)]
    assert [p["labels"].shape[1] for p in pieces] == [8, 8, 8]  # it cut them to 3 and 4: 12 of 23 kept
    assert sum(int((p["labels"] != -100).sum()) for p in pieces) == int((labels != -100).sum())


def test_padding_is_cut_and_the_cut_is_contiguous():
    mask = _mask()
    labels = (mask * 7).masked_fill(mask == 0, -100)
    batch = {"input_ids": mask * 9, "attention_mask": mask, "labels": labels}
    first = split_by_tokens(batch, 8, lengths=mask.sum(1))[0]
    assert first["labels"].shape == (2, 3) and first["labels"].is_contiguous()
    first["labels"].view(-1)  # what BERT's and T5's losses call


def test_the_padded_width_is_the_token_tensors_not_a_rows_features():
    mask = _mask()
    batch = {
        "input_ids": mask * 9,
        "attention_mask": mask,
        "speaker": torch.randn(4, 16),
        "y": torch.arange(4),
    }
    pieces = split_by_tokens(batch, 8, lengths=mask.sum(1))
    assert [tuple(p["input_ids"].shape) for p in pieces] == [(2, 3), (1, 8), (1, 4)]
    assert all(p["speaker"].shape[1] == 16 for p in pieces)  # it was cut to 3 and the budget read as 16 wide
    assert all(p["input_ids"].numel() <= 8 for p in pieces)
    features = {
        "input_features": torch.randn(2, 80, 30),
        "labels": torch.tensor([[1, 2, 3, -100], [4, 5, -100, -100]]),
    }
    pieces = split_by_tokens(features, 6, lengths=[3, 2])
    assert [tuple(p["input_features"].shape) for p in pieces] == [(2, 80, 30)]  # its mel bins were cut to 3
    assert pieces[0]["labels"].shape == (2, 3)


def test_a_label_one_column_past_the_inputs_is_kept():
    """An encoder-decoder's labels one token longer than the inputs' longest row: a one-column tail 'repeats its
    first position' trivially; padded as the lengths say it is not (row 0's EOS there), so it is not cut."""
    mask = torch.tensor([[1] * 7 + [0], [1, 1, 1, 0, 0, 0, 0, 0]])
    labels = torch.tensor([[11, 12, 13, 14, 15, 16, 17, 2], [11, 12, 2] + [-100] * 5])
    batch = {"input_ids": mask * 9, "attention_mask": mask, "labels": labels}
    (piece,) = split_by_tokens(batch, 16, lengths=mask.sum(1))
    assert piece["input_ids"].shape == (2, 7) and piece["labels"].shape == (2, 8)  # the EOS kept


def test_left_padded_ids_are_refused_rather_than_cut_apart_from_their_mask():
    import pytest

    from microbatch.errors import ConfigError

    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    ids = torch.tensor([[0, 0, 5, 6, 7], [0, 4, 5, 6, 7], [3, 4, 5, 6, 7]])
    with pytest.raises(ConfigError, match="left-padded rows.*trim_padding=False"):
        split_by_tokens({"input_ids": ids, "attention_mask": mask}, 8, lengths=mask.sum(1))
    pieces = split_by_tokens(
        {"input_ids": ids, "attention_mask": mask}, 10, lengths=mask.sum(1), trim_padding=False
    )
    assert all(p["input_ids"].shape[1] == p["attention_mask"].shape[1] == 5 for p in pieces)
