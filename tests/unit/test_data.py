"""Tests for the byte-level datasets in zoo.data."""

import pytest
import torch

from zoo.data import (
    ByteSequenceDataset,
    random_token_dataset,
    stdlib_corpus,
    stdlib_source_files,
    text_batches,
)


@pytest.fixture
def fake_stdlib(tmp_path):
    (tmp_path / "b.py").write_bytes(b"BB")
    (tmp_path / "a.py").write_bytes(b"AAA")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "c.py").write_bytes(b"C")
    (tmp_path / "notes.txt").write_bytes(b"ignored")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "x.py").write_bytes(b"third party")
    return tmp_path


def test_source_files_sorted_and_filtered(fake_stdlib):
    rel = [p.relative_to(fake_stdlib).as_posix() for p in stdlib_source_files(fake_stdlib)]
    assert rel == ["a.py", "b.py", "pkg/c.py"]


def test_corpus_concatenates_in_sorted_order(fake_stdlib):
    tokens = stdlib_corpus(root=fake_stdlib)
    assert tokens.dtype == torch.int64
    assert tokens.tolist() == list(b"AAABBC")


def test_corpus_truncates_at_max_bytes(fake_stdlib):
    assert stdlib_corpus(max_bytes=4, root=fake_stdlib).tolist() == list(b"AAAB")


def test_corpus_errors(tmp_path):
    with pytest.raises(ValueError, match="max_bytes must be positive, got 0"):
        stdlib_corpus(max_bytes=0, root=tmp_path)
    with pytest.raises(FileNotFoundError, match="no .py files found under"):
        stdlib_corpus(root=tmp_path)


def test_real_stdlib_corpus_is_deterministic_bytes():
    a = stdlib_corpus(max_bytes=20_000)
    b = stdlib_corpus(max_bytes=20_000)
    assert a.shape == (20_000,)
    assert torch.equal(a, b)
    assert 0 <= int(a.min()) and int(a.max()) <= 255
    # Python source: mostly printable ASCII, and newlines.
    assert (a == ord("\n")).sum() > 100


def test_dataset_exact_shift_and_windows():
    ds = ByteSequenceDataset(torch.arange(11), seq_len=3)
    assert len(ds) == 3  # (11 - 1) // 3
    x0, y0 = ds[0]
    assert x0.tolist() == [0, 1, 2] and y0.tolist() == [1, 2, 3]
    x2, y2 = ds[2]
    assert x2.tolist() == [6, 7, 8] and y2.tolist() == [7, 8, 9]
    assert ds[-1][0].tolist() == [6, 7, 8]


def test_dataset_length_uses_last_token_only_as_target():
    assert len(ByteSequenceDataset(torch.arange(10), seq_len=3)) == 3  # 9 // 3: token 9 is a target
    assert len(ByteSequenceDataset(torch.arange(9), seq_len=3)) == 2  # 8 // 3


def test_dataset_index_out_of_range():
    ds = ByteSequenceDataset(torch.arange(7), seq_len=3)
    with pytest.raises(IndexError, match="index 2 out of range for dataset of length 2"):
        ds[2]
    with pytest.raises(IndexError, match="index -3 out of range"):
        ds[-3]


def test_dataset_errors():
    with pytest.raises(ValueError, match=r"tokens must be 1-D, got shape \(2, 3\)"):
        ByteSequenceDataset(torch.zeros(2, 3, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="seq_len must be positive, got 0"):
        ByteSequenceDataset(torch.arange(5), 0)
    with pytest.raises(ValueError, match=r"need at least seq_len \+ 1 = 5 tokens, got 4"):
        ByteSequenceDataset(torch.arange(4), 4)


def test_dataset_works_with_dataloader():
    ds = ByteSequenceDataset(torch.arange(13), seq_len=4)
    x, y = next(iter(torch.utils.data.DataLoader(ds, batch_size=3)))
    assert x.shape == y.shape == (3, 4)
    assert torch.equal(y[:, :-1], x[:, 1:])


def test_random_token_dataset_length_range_and_determinism():
    a, b, c = (random_token_dataset(5, 8, vocab=10, seed=s) for s in (1, 1, 2))
    assert len(a) == 5
    assert torch.equal(a.tokens, b.tokens)
    assert not torch.equal(a.tokens, c.tokens)
    assert a.tokens.numel() == 41 and int(a.tokens.max()) < 10
    x, y = a[4]
    assert torch.equal(x[1:], y[:-1])


def test_text_batches_are_consecutive_dataset_windows():
    steps, batch, seq = 3, 4, 8
    ds = ByteSequenceDataset(stdlib_corpus(max_bytes=steps * batch * seq + 1), seq)
    got = text_batches(steps, batch, seq)
    assert len(got) == steps
    for s, (x, y) in enumerate(got):
        assert x.shape == y.shape == (batch, seq)
        for b in range(batch):
            want_x, want_y = ds[s * batch + b]
            assert torch.equal(x[b], want_x) and torch.equal(y[b], want_y)
