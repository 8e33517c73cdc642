"""--use-checkpoint-args: a run names the checkpoint and its own training settings, and gets the
model and tokenizer the checkpoint was trained with; what the command line names wins."""
import pytest
import torch

from megatron.training.arguments import ArgsError
from megatron.training.checkpoint_args import MODEL
from megatron.training.training import check_load, load_and_report, parse_and_validate, setup
from tests.unit_tests.dist_utils import grid_groups
from tests.unit_tests.model_utils import tiny_gpt
from tests.unit_tests.training.test_check_load import saved_state

# A model unlike the defaults in every way the weights show, and a tokenizer that is no default
SAVED = ("--num-layers 3 --hidden-size 64 --num-attention-heads 8 --group-query-attention --num-query-groups 4 "
         "--swiglu --normalization RMSNorm --position-embedding-type rope --rotary-base 50000 "
         "--untie-embeddings-and-output-weights --disable-bias-linear --vocab-size 150 "
         "--make-vocab-size-divisible-by 153")  # 151 ids (NullTokenizer adds its eod) in 153 rows
# What a run that reads it names: training only
RUN = ("--use-checkpoint-args --micro-batch-size 2 --train-iters 10 --lr 1e-3 --mock-data --hidden-dropout 0 "
       "--attention-dropout 0 --distributed-backend gloo")


def _saved(tmp_path, fmt):
    """A checkpoint of the SAVED model in `fmt`; its arguments and weights."""
    args, _, state = saved_state(tmp_path, fmt, SAVED)
    return args, state.model[0].state_dict()


def _run(tmp_path, fmt, extra=""):
    return parse_and_validate(f"{RUN} --load {tmp_path} --ckpt-format {fmt} {extra}".split())


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_the_model_and_tokenizer_come_from_the_checkpoint_and_load(tmp_path, fmt):
    saved, weights = _saved(tmp_path, fmt)
    args = _run(tmp_path, fmt)
    differ = {n: (getattr(args, n), getattr(saved, n)) for n in MODEL if getattr(args, n) != getattr(saved, n)}
    assert not differ
    assert args.tokenizer_type == "NullTokenizer" and args.padded_vocab_size == 153
    pgs = grid_groups()
    check_load(args, pgs)  # the load's own check passes: the model is the saved one
    state = setup(args, pgs, lambda a, p, d: tiny_gpt(a, p))
    load_and_report(args, state, pgs)
    loaded = state.model[0].state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in weights.items() if torch.is_tensor(v))


def test_a_setting_the_command_line_names_wins(tmp_path):
    _saved(tmp_path, "torch")
    args = _run(tmp_path, "torch", "--seq-length 16 --rotary-base 10000 --make-vocab-size-divisible-by 128")
    assert (args.seq_length, args.rotary_base, args.num_layers) == (16, 10000, 3)
    # the table keeps the checkpoint's 153 rows, not the 256 that 128 would pad to
    assert args.padded_vocab_size == 153


def test_a_setting_that_contradicts_the_weights_is_refused_at_start_up(tmp_path):
    _saved(tmp_path, "torch_dist")
    args = _run(tmp_path, "torch_dist", "--hidden-size 96")
    with pytest.raises(ArgsError, match="checkpoint has hidden_size=64 but this run has 96"):
        check_load(args, grid_groups())


def test_the_layout_is_taken_only_when_asked(tmp_path):
    _saved(tmp_path, "torch")
    with pytest.raises(ArgsError, match=r"world size 1 is not divisible by tensor \(2\)"):
        _run(tmp_path, "torch", "--tensor-model-parallel-size 2")  # a world of one rank
    args = _run(tmp_path, "torch", "--tensor-model-parallel-size 2 --use-mp-args-from-checkpoint-args")
    assert args.tensor_model_parallel_size == 1


def test_a_table_that_no_longer_splits_is_one_line(tmp_path, monkeypatch):
    _saved(tmp_path, "torch")
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    with pytest.raises(ArgsError, match="the checkpoint's 153 vocabulary rows cannot hold the tokenizer's 151 ids "
                                        "split over --tensor-model-parallel-size 2"):
        _run(tmp_path, "torch", "--tensor-model-parallel-size 2")


@pytest.mark.parametrize("load, message", [
    ("", "--use-checkpoint-args: needs --load, the checkpoint whose settings it reads"),
    ("--load {tmp}", "--use-checkpoint-args: no checkpoint under --load .* names none"),
])
def test_nothing_to_read_is_one_line(tmp_path, load, message):
    with pytest.raises(ArgsError, match=message):
        parse_and_validate(f"{RUN} {load.format(tmp=tmp_path)}".split())
