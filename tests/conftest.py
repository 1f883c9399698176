import pytest


@pytest.fixture(scope="session")
def char_tokenizer():
    """A tiny word-level tokenizer: ids 0..3 are specials, then one id per character of ALPHABET."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    alphabet = "abcdefgh ."
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, "<bos>": 3}
    vocab.update({c: i + 4 for i, c in enumerate(alphabet)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", bos_token="<bos>")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, request):
    """Saved tiny models: Target and draft (same char tokenizer) and an 'alien' model with another tokenizer."""
    from helpers import tiny_llama

    char_tokenizer = request.getfixturevalue("char_tokenizer")
    root = tmp_path_factory.mktemp("models")
    vocab = len(char_tokenizer)
    dirs = {}
    for name, seed, layers in (("target", 0, 2), ("draft", 1, 1)):
        model = tiny_llama(seed, layers=layers, vocab=vocab)
        model.save_pretrained(root / name)
        char_tokenizer.save_pretrained(root / name)
        dirs[name] = str(root / name)
    alien_tok = char_tokenizer.__class__(tokenizer_object=char_tokenizer.backend_tokenizer, eos_token="<eos>")
    alien_tok.add_tokens(["zz"])
    tiny_llama(2, layers=1, vocab=len(alien_tok)).save_pretrained(root / "alien")
    alien_tok.save_pretrained(root / "alien")
    dirs["alien"] = str(root / "alien")
    return dirs


@pytest.fixture(scope="session")
def long_model_dirs(model_dirs, tmp_path_factory):
    """The tiny target and draft with a 16384-token context window: a long request runs for seconds
    to minutes (rotary positions: nothing is sized by it)."""
    import json
    import shutil

    root = tmp_path_factory.mktemp("long")
    dirs = {}
    for name in ("target", "draft"):
        shutil.copytree(model_dirs[name], root / name)
        config = json.loads((root / name / "config.json").read_text())
        config["max_position_embeddings"] = 16384
        (root / name / "config.json").write_text(json.dumps(config))
        dirs[name] = str(root / name)
    return dirs


@pytest.fixture(scope="session")
def peaked(tmp_path_factory, char_tokenizer):
    """(helpers.peaked_llama(0) over the char tokenizer, the directory it is saved in): sharp
    distributions, so earlier outputs make good drafts for later ones."""
    from helpers import peaked_llama

    model = peaked_llama(0, len(char_tokenizer))
    path = tmp_path_factory.mktemp("peaked")
    model.save_pretrained(path)
    char_tokenizer.save_pretrained(path)
    return model, str(path)


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory):
    """$SPECDECODE_CACHE pointed at a folder of the requesting module's own for its duration
    (converted GGUF files, tokenizers, choices), then restored."""
    import os
    from pathlib import Path

    before = os.environ.get("SPECDECODE_CACHE")
    os.environ["SPECDECODE_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    yield Path(os.environ["SPECDECODE_CACHE"])
    if before is None:
        del os.environ["SPECDECODE_CACHE"]
    else:
        os.environ["SPECDECODE_CACHE"] = before


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    """{"target", "draft"}: paths of tiny random Qwen2-architecture F32 GGUF files (the draft a
    perturbed target), built by specdecode.models.tiny_gguf for the requesting module."""
    from specdecode.models.tiny_gguf import build_tiny

    return {name: str(path) for name, path in build_tiny(tmp_path_factory.mktemp("gguf")).items()}

