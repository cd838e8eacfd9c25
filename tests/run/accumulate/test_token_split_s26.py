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
