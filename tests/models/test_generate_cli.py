"""`kalmix generate` on a saved model with a locally trained tokenizer."""
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kalmix.cli import main
from kalmix.models.decoding import Decoder
from tests.models.test_models import model


def test_generate_command_prints_the_greedy_continuation(tmp_path, capsys):
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    bpe.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20,
                            trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe)
    m = model(["kaczmarz", "attention"], dtype=torch.float32, vocab_size=bpe.get_vocab_size())
    m.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--prompt", "the quick", "--max-new-tokens", "5",
                 "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    ids = torch.tensor([tok("the quick").input_ids])
    want = Decoder(m, 1, ids.shape[1] + 5, graph=False).generate(ids, 5)[0, ids.shape[1]:]
    assert out == "the quick" + tok.decode(want.tolist()) + "\n"
    assert "5 tokens in" in err and "tokens/s" in err and "eager" in err
