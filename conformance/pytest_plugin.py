"""The pytest entry point of the conformance suite (registered as ``pytest11``).

Inert unless asked: it only adds options.  Two ways to use it:

* ``pytest --storage=package.module:factory`` runs the whole suite on that factory
  (the plugin adds its own test file to the run; with no paths given, only the suite);
* in a test file, opt a backend in with one line::

      from conformance import StorageSuite

      class TestMine(StorageSuite):
          factory = staticmethod(my_factory)

Options: ``--storage-profile quick|thorough`` (default: quick, or thorough when
QUEUE_REF_PROFILE=thorough), ``--storage-models process-kill,weak,...`` and
``--storage-seed N`` (default 0, so runs repeat).
"""

from __future__ import annotations

import os

import pytest

SUITE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "certify",
                          "_storage_tests.py")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("queue-ref", "queue-ref conformance suite for Storage backends")
    group.addoption("--storage", metavar="MODULE:FACTORY", default=None,
                    help="run the conformance suite on the Storage this factory opens")
    group.addoption("--storage-profile", choices=("quick", "thorough"), default=None,
                    help="how hard the suite tries (default: quick; thorough when "
                         "QUEUE_REF_PROFILE=thorough)")
    group.addoption("--storage-models", metavar="M1,M2", default=None,
                    help="crash models to check (default: process-kill,weak,ext4-ordered)")
    group.addoption("--storage-seed", type=int, default=None,
                    help="seed of the suite's random choices (default: 0)")


def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption("storage"):
        return
    if config.args_source is pytest.Config.ArgsSource.ARGS:
        config.args.append(SUITE_FILE)  # the user's own paths, and the suite
    else:
        config.args[:] = [SUITE_FILE]  # no paths given: only the suite


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "queue_ref_crash_model" in metafunc.fixturenames:
        from conformance.certify.pytest_suite import selected_models

        metafunc.parametrize("queue_ref_crash_model", selected_models(metafunc.config))
