"""Hugging Face ``Trainer`` training a model compiled by ``mirrorgrad.compile``.

accelerate checks ``torch_compile_backend`` against a fixed list (``DynamoBackend``),
so ``TrainingArguments(torch_compile_backend="mirrorgrad")`` is refused: the model is
compiled before it is handed to ``Trainer``."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="pip install -e '.[hf]'")
pytest.importorskip("accelerate", reason="pip install -e '.[hf]'")

import mirrorgrad  # noqa: E402
from mirrorgrad.mirror.partition import MirrorgradFallbackWarning  # noqa: E402


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _train(model, out_dir, steps: int = 3):
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), max_steps=steps, per_device_train_batch_size=4,
        learning_rate=1e-2, use_cpu=True, report_to=[], save_strategy="no", seed=0,
        logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
        remove_unused_columns=False,  # a compiled model's forward shows no argument names
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(12, 16, 64))
    trainer.train()
    return trainer


@pytest.mark.slow
def test_trainer_trains_a_compiled_gpt2_and_its_checkpoint_loads(tmp_path):
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    reference = transformers.GPT2LMHeadModel(config)
    model = copy.deepcopy(reference)
    compiled = mirrorgrad.compile(model, mode="budget", budget=0.5, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _train(compiled, tmp_path / "mirrorgrad")
    assert not [w for w in caught if issubclass(w.category, MirrorgradFallbackWarning)]
    assert compiled._mirrorgrad_plans, "the planner never ran"
    _train(reference, tmp_path / "eager")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)

    # Save the model, not the compiled wrapper: Trainer.save_model(compiled) writes its
    # keys with an "_orig_mod." prefix that from_pretrained silently drops.
    assert trainer.model is compiled
    model.save_pretrained(str(tmp_path / "ckpt"))
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "ckpt"))
    for key, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, msg=key)
