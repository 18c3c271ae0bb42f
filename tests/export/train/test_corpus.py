from export.train.corpus import held_out_prompts, stdlib_corpus, write_prompts
from export.train.tokenizer import SPECIAL_TOKENS, save_tokenizer, special_ids, train_tokenizer


def _fake_stdlib(root):
    for i in range(40):
        sub = root / ("pkg" if i % 3 else "") / f"mod{i}.py"
        sub.parent.mkdir(parents=True, exist_ok=True)
        sub.write_text(f"def f{i}(x):\n    return x + {i}\n\n\nclass C{i}:\n    pass\n" * 20)
    (root / "test").mkdir()
    (root / "test" / "test_x.py").write_text("def test(): pass\n")
    return root


def test_split_is_deterministic_disjoint_and_skips_tests(tmp_path) -> None:
    root = _fake_stdlib(tmp_path)
    a, b = stdlib_corpus(root), stdlib_corpus(root)
    assert a == b and a.fingerprint() == b.fingerprint()
    assert a.held_out_files and a.train_files
    assert not set(a.train_files) & set(a.held_out_files)
    assert not any(name.startswith("test/") for name in a.train_files + a.held_out_files)
    before = a.fingerprint()
    (root / "mod0.py").write_text("changed = 1\n")
    assert stdlib_corpus(root).fingerprint() != before


def test_texts_respect_the_budget_and_prompts_come_from_held_out_files(tmp_path) -> None:
    corpus = stdlib_corpus(_fake_stdlib(tmp_path))
    texts = corpus.texts("train", 5000)
    assert texts and sum(map(len, texts)) <= 5000
    prompts = held_out_prompts(corpus, 3)
    held_text = "".join((corpus.root / n).read_text() for n in corpus.held_out_files)
    assert len(prompts) == 3 and all(p.startswith(("def ", "class ")) and p in held_text for p in prompts)
    write_prompts(prompts, tmp_path / "p.jsonl")
    assert len((tmp_path / "p.jsonl").read_text().splitlines()) == 3


def test_tokenizer_is_byte_level_with_the_special_tokens_first(tmp_path) -> None:
    texts = ["def spam(eggs):\n    return eggs * 2\n" * 50, "import os\nprint(os.sep)\n" * 50]
    tokenizer = train_tokenizer(texts, 300)
    assert special_ids(tokenizer) == {name: i for i, name in enumerate(SPECIAL_TOKENS)}
    unseen = "λ = lambda: 'ünïcode'\n"
    assert tokenizer.decode(tokenizer.encode(unseen).ids) == unseen          # bytes never become unknown
    assert train_tokenizer(texts, 300).get_vocab() == tokenizer.get_vocab()
    save_tokenizer(tokenizer, tmp_path)
    assert (tmp_path / "tokenizer.json").is_file() and (tmp_path / "tokenizer_config.json").is_file()
