"""Certification: run every check on a backend, build the certificate, write reports.

* ``suite_runner``: ``certify(factory)`` runs every check of the catalog and returns the
  ``certificate.Certificate`` (the clause x crash-model matrix and the verdict);
* ``certificate_report``: report.md and report.html from ``templates/``;
* ``scenario_replay``: ``queue-ref certify FACTORY --scenario ID`` for any check's ids;
* ``certify_command``: the ``queue-ref certify`` command;
* ``pytest_suite``: ``StorageSuite``, the same checks as pytest tests (the plugin
  ``conformance.pytest_plugin`` adds ``_storage_tests.py`` for ``--storage``).
"""
