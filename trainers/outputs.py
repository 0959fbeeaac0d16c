"""The outputs of the trainer's commands (entroweight.output's contract): a training run's checkpoint,
an exported Hugging Face model, an evaluation's results. Light: no torch (source discovery asks).
"""

from __future__ import annotations

from entroweight.output import Mark, Output, declare

#: export-hf's mark: what it exported from, sealed last (a stopped export is its own: made again)
EXPORT_HF_MARK = "entroweight-export.json"
#: evaluate's results (its mark, sealed last) and its items, written first: a run stopped before its
#: results is still its own
RESULTS, ITEMS_FILE = "accuracy.json", "items.jsonl"

TRAIN = declare(
    Output(
        "train",
        # trainer_state.json, written last by each save, commits a checkpoint (trainers/checkpoint.py)
        marks=(Mark("trainer_state.json", ("step", "weights_sha256", "optimizer_sha256", "position")),),
        files=(
            "trainer_state.json",
            "tokenizer.json",
            "metrics.jsonl",
            "config.json",
            "model.safetensors",
            "optimizer.safetensors",
        ),  # fmt: skip
        # a run stopped in its first save: --resume has nothing to continue, --overwrite starts over
        leftovers=True,
        # the same command again continues the run its --out holds (config.json records what it is made of)
        resumable=lambda directory: _checkpoint_made_of(directory),
    )
)


def _checkpoint_made_of(directory):
    from .loop import recorded_made_of  # torch: asked by train alone, never by source discovery

    return recorded_made_of(directory)


EXPORT_HF = declare(
    Output(
        "export-hf",
        marks=(Mark(EXPORT_HF_MARK),),  # not model.safetensors: any HF model folder holds one
        # what transformers' `save_pretrained` writes for a model and its tokenizer
        files=("*.json", "*.safetensors", "*.jinja", "tokenizer.model"),
        record=EXPORT_HF_MARK,
    )
)
EVALUATE = declare(
    Output(
        "evaluate",
        marks=(
            Mark(RESULTS, ("tasks", "groups", "lm_eval")),
            Mark(ITEMS_FILE, ("prefix", "choices", "label", "doc", "cut", "tokens")),
        ),
        files=(RESULTS, ITEMS_FILE, "*.tmp"),
        record=RESULTS,
    )
)
