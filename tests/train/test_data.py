import pytest
import torch

from mirrorgrad.train import data
from mirrorgrad.train.data import EOS, UNK, Vocabulary


def test_tokenize_words_and_chars():
    text = "the cat  sat\n\n  on the mat \n"
    assert data.tokenize(text) == ["the", "cat", "sat", EOS, "on", "the", "mat", EOS]
    assert data.tokenize("ab c\nd", char=True) == ["a", "b", " ", "c", EOS, "d", EOS]


def test_vocabulary_cap_unk_and_order():
    tokens = data.tokenize("b a b c b a\nd")
    vocab = Vocabulary.build(tokens, max_size=4)
    # <unk>, <eos>, then by frequency: b (3), a (2); c and d are cut.
    assert vocab.tokens == [UNK, EOS, "b", "a"]
    assert vocab.encode(["a", "c", EOS, "b"]).tolist() == [3, 0, 1, 2]
    assert len(Vocabulary.build(tokens)) == 6


def test_find_splits_layouts(tmp_path):
    for name in ("wiki.train.tokens", "wiki.valid.tokens"):
        (tmp_path / name).write_text("x\n")
    splits = data.find_splits(tmp_path)
    assert splits.train.name == "wiki.train.tokens"
    assert splits.valid.name == "wiki.valid.tokens"
    assert splits.test is None
    single = tmp_path / "wiki.train.tokens"
    assert data.find_splits(single) == data.SplitPaths(train=single, valid=None, test=None)


def test_batchify_columns_and_bptt_windows():
    ids = torch.arange(23)
    batches = data.batchify(ids, 4)  # 5 rows; tokens 20..22 dropped
    assert batches.shape == (5, 4)
    assert batches[:, 1].tolist() == [5, 6, 7, 8, 9]  # a column is a contiguous stream
    assert data.num_windows(batches, 3) == 2  # 4 targets per column: windows of 3 and 1
    assert data.num_windows(batches, 3, drop_last=True) == 1
    x, y = data.window(batches, 1, 3)
    assert x.tolist() == [[3, 8, 13, 18]]
    assert y.tolist() == [[4, 9, 14, 19]]
    windows = list(data.windows(batches, 3))
    assert torch.equal(torch.cat([x for x, _ in windows]), batches[:-1])
    assert torch.equal(torch.cat([y for _, y in windows]), batches[1:])


def test_shard_columns_partition_the_batch():
    batches = data.batchify(torch.arange(40), 4)
    shards = [data.shard_columns(batches, r, 2) for r in range(2)]
    assert torch.equal(torch.cat(shards, dim=1), batches)
    with pytest.raises(ValueError, match="divisible"):
        data.shard_columns(batches, 0, 3)


def test_load_corpus_encodes_splits_with_train_vocab(tmp_path):
    (tmp_path / "ptb.train.txt").write_text("a b a\nb c\n")
    (tmp_path / "ptb.valid.txt").write_text("a z\n")
    corpus = data.load_corpus(data.find_splits(tmp_path))
    assert corpus.vocab.tokens[:2] == [UNK, EOS]
    assert corpus.train.numel() == 7
    assert corpus.valid.tolist() == [corpus.vocab.index["a"], 0, 1]  # z -> <unk>
    assert corpus.test is None


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        data.find_splits(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no training file"):
        data.find_splits(tmp_path)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n")
    with pytest.raises(ValueError, match="empty"):
        data.read_text(empty)
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("café au lait".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt is not UTF-8 text: byte 3"):
        data.read_text(latin)
    with pytest.raises(ValueError, match="too few"):
        data.batchify(torch.arange(5), 4)
