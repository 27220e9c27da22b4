"""Where the workers live and how EngineCore reaches them: the `Executor` protocol and the
multi-rank base (`base`), `create_executor` (`factory`), and one executor per backend:
`UniprocExecutor` (one Worker in this process), `MultiprocExecutor` (a process per rank) and
`RayExecutor` (a Ray actor per rank).

Import rule: executor imports worker, distributed, `step`, `process_start` and the leaf
modules (`config`, `errors`, ...); never `engine` or `entrypoints`. The engine imports
`executor.factory` and `step`, not worker.
"""
