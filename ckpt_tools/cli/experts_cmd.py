"""Placeholder: this verb is not implemented yet."""


def register(app) -> None:
    pass
