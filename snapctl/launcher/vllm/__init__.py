"""vLLM in startup-capture mode, for released vLLM that lacks ``--snapshot-config`` (#59851).

``python -m snapctl.launcher.vllm serve MODEL [vllm serve options] --snapshot-config JSON``
runs vLLM's own engine and OpenAI app under :func:`snapctl.launcher.run_startup_capture`; without
``--snapshot-config`` it is ``vllm serve``. Modules:

- :mod:`.cli`: splits the command line, parses vLLM's options with vLLM's own parser.
- :mod:`.hooks`: the startup hooks (canary through the engine, release, reload and check).
- :mod:`.app`: vLLM's app and its state, plus the debug routes qualification reads; binds and
  serves only when asked.
- :mod:`.worker`: the worker extension that computes digests and reloads weights in the worker.

Nothing here is imported by snapctl itself; it runs inside a vLLM environment.
"""
