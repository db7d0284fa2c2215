"""twinkle-kit's Megatron recipes end to end in twinkle's Ray mode, one driver process
(tests/integrations/twinkle/test_recipes_megatron_ray.py starts one per TWINKLE_MEM_INSTALL value, each in a fresh
process).

    python tests/integrations/twinkle/ray_megatron_recipes.py OUT STUDENT_DIR TEACHER_DIR RUN[,RUN...]

RUN is ``recipe:layout`` (standins/recipes.py: ``grpo``, ``grpo_multi_lora``, ``gkd``, ``dpo``; layout ``tp2`` or
``pp2``), or ``bf16:layout``: the first step of the GRPO, GKD and DPO recipes on one bf16 model
(``mixed_precision='bf16'``), each loss with its float64 reference (standins/recipe_reference.py). All runs in
one Ray session, each with a model of its own in 2 CPU workers. Writes OUT (torch.save): the driver's pid and
TWINKLE_MEM_INSTALL, and each run's results. The workers' start-up lines reach this process's output through Ray.
"""
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))  # standins/


def main(out, student, teacher, runs):
    from standins import recipes
    from standins import twinkle_ray as tr
    results = dict(driver_pid=os.getpid(), variable=os.environ.get("TWINKLE_MEM_INSTALL"), runs={})
    with tr.ray_session(), tempfile.TemporaryDirectory(prefix="recipe-saves-") as saves:  # (the adapters: read back)
        for run in runs.split(","):
            name, layout = run.split(":")
            print(f"[recipes] {run}", file=sys.stderr, flush=True)
            if name == "bf16":
                from standins import recipe_reference
                result = recipe_reference.bf16_first_steps(student, layout, teacher)
            else:
                extra = (teacher, ) if name.startswith("gkd") else ()
                result = recipes.RECIPES[name](student, layout, recipes.output_dir(saves), *extra)
            results["runs"][run] = result
            print(f"[recipes] {run}: {result.get('error') or 'done'}", file=sys.stderr, flush=True)
    torch.save(results, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
