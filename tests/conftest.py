import pytest
import torch

from specdecode.models import TableModel


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
    from test_transformers import tiny_llama

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


def table_pair(vocab_size=6, order=2, target_seed=0, draft_seed=1, **kw):
    return TableModel(vocab_size, order, target_seed, **kw), TableModel(vocab_size, order, draft_seed, **kw)


def random_probs(shape, generator, zero_frac=0.0):
    logits = torch.randn(shape, generator=generator) * 2
    probs = torch.softmax(logits, -1)
    if zero_frac:
        mask = torch.rand(shape, generator=generator) < zero_frac
        mask[..., 0] = False  # keep at least one entry
        probs = probs.masked_fill(mask, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def chi2_pvalue(observed, probs):
    """Chi-square goodness-of-fit p-value of counts against probabilities (categories with
    zero probability must have zero counts, else the p-value is 0)."""
    from scipy.stats import chisquare

    observed = torch.as_tensor(observed, dtype=torch.float64)
    probs = torch.as_tensor(probs, dtype=torch.float64)
    if (observed[probs == 0] > 0).any():
        return 0.0
    keep = probs > 0
    expected = probs[keep] / probs[keep].sum() * observed.sum()
    return float(chisquare(observed[keep].numpy(), expected.numpy()).pvalue)
