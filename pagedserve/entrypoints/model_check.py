"""A one-line error for a local model folder that is missing or unsupported."""


def check_local_model(model: str | None, command: str) -> None:
    """End the command with one line, before the web stack, torch or transformers load, when
    `model` names a local folder that is missing or has no config.json (a name that can be
    a Hub id is left to the Hub lookup)."""
    import os

    from pagedserve.engine.hub import looks_like_repo_id
    from pagedserve.engine.model_files import check_model_folder
    from pagedserve.errors import UnsupportedModelError

    if model is None or (not os.path.isdir(model) and looks_like_repo_id(model)):
        return
    try:
        check_model_folder(model)
    except UnsupportedModelError as e:
        raise SystemExit(f"pagedserve {command}: error: {e}") from None
