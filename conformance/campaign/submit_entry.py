"""``queue-ref`` as a spark-submit application, so a cluster runs campaigns its own way:

    spark-submit --master spark://HOST:7077 --py-files queue_ref.zip \\
        conformance/campaign/submit_entry.py campaign run --bound 5 --out DIR

The session is spark-submit's (its master, resources and configuration); the packages
reach the executors through ``--py-files`` (``python -m conformance.campaign.spark_setup
queue_ref.zip`` builds the zip).
"""

from __future__ import annotations

import sys

from conformance.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
