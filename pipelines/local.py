"""The local engine: shards one after another in this process, with a progress bar."""

from __future__ import annotations

from .stage import EngineOption, RunPlan, ShardResult, StageError, run_task, shuffle_here

OPTIONS: dict[str, EngineOption] = {}  # nothing to set: one process, one shard after another


# a whole-input plan's map and group (`Stage.whole_plan`): in this process, a partition at a time
shuffle = shuffle_here


def run(plan: RunPlan, progress: bool = True) -> list[ShardResult]:
    stage = plan.stage
    try:
        stage.setup()  # once: the tokenizer or model stays loaded across shards
    except (ValueError, OSError) as e:  # a model or tokenizer that cannot load: refused, not a traceback
        raise StageError(f"{stage.name} cannot start: {e}") from e
    results = []
    docs = tokens = 0
    with plan.progress(disable=not progress) as bar:
        for task in plan.todo:
            result = run_task(stage, task)
            results.append(result)
            docs += sum(m["docs_in"] for m in result.manifests)
            tokens += sum(m["n_real_tokens"] for m in result.manifests)
            elapsed = bar.format_dict["elapsed"] or 1e-9
            bar.set_postfix(
                docs=docs, tok_s=f"{tokens / elapsed:,.0f}", failed=sum(not r.ok for r in results)
            )
            bar.update()
    return results
