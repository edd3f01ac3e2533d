"""A SparkSession for campaigns: Java found, logs quiet, executors running our Python.

``spark_session(master)`` reuses the active session when there is one (a test's, or
``spark-submit``'s) and says whether it made a new one (then the caller stops it).  In
local mode and on a loopback cluster the executors run this interpreter; on another
cluster ``PYSPARK_PYTHON`` names theirs, and the project's packages are shipped to them as
a zip (``ship_packages``).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

INSTALL_HINT = ("queue-ref campaign needs Spark: pip install 'queue-ref[campaign]' "
                "(pyspark, pandas, pyarrow, matplotlib) and Java 17 or later")
PACKAGES = ("spec", "queue_ref", "faultinject", "conformance")
#: SPARK_CONF_DIR (unless the user has one): log4j2.properties there keeps Spark's logs to
#: errors (the driver's JVM reads it before any option of ours could reach it)
CONF_DIR = Path(__file__).with_name("spark_conf")
LOG_CONFIG = CONF_DIR / "log4j2.properties"


def missing_extra() -> str | None:
    """None if the campaign extra is installed, else the line that says how to install it."""
    try:
        import matplotlib  # noqa: F401
        import pyarrow  # noqa: F401
        import pyspark  # noqa: F401
    except ImportError:
        return INSTALL_HINT
    return None


def find_java() -> str | None:
    """Set JAVA_HOME from the ``java`` on PATH when it is not set; None if there is none."""
    home = os.environ.get("JAVA_HOME")
    if home and Path(home, "bin", "java").exists():
        return home
    java = shutil.which("java")
    if java is None:
        return None
    home = str(Path(os.path.realpath(java)).parents[1])
    os.environ["JAVA_HOME"] = home
    return home


def is_loopback(master: str) -> bool:
    return master.startswith("local") or master.startswith(("spark://127.0.0.1",
                                                            "spark://localhost"))


def under_spark_submit() -> bool:
    """Whether this process is a driver spark-submit started (it made the JVM)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def spark_session(master: str | None = None, *, ui: bool = False,
                  app: str = "queue-ref campaign") -> tuple[Any, bool]:
    """The active SparkSession, or a new one on ``master`` (default: spark-submit's, else
    local[*]): (session, made_here)."""
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active, False
    if under_spark_submit() and master is None:
        spark = SparkSession.builder.appName(app).getOrCreate()
        spark.sparkContext.setLogLevel("ERROR")
        return spark, True
    master = master or "local[*]"
    if find_java() is None:
        raise RuntimeError("no java on PATH and JAVA_HOME unset: Spark needs Java 17 or later")
    os.environ.setdefault("SPARK_CONF_DIR", str(CONF_DIR))
    b = (SparkSession.builder.master(master).appName(app)
         .config("spark.ui.enabled", str(ui).lower())
         .config("spark.ui.showConsoleProgress", "false")
         .config("spark.driver.extraJavaOptions",
                 f"-Dlog4j2.configurationFile=file:{LOG_CONFIG}")
         .config("spark.executor.extraJavaOptions",
                 f"-Dlog4j2.configurationFile=file:{LOG_CONFIG}")
         .config("spark.python.worker.reuse", "true"))
    if is_loopback(master):
        b = (b.config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1"))
        # the executors run this interpreter (pyspark takes it from the environment)
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    if not master.startswith("local"):
        ship_packages(spark.sparkContext)
    return spark, True


def package_zip(out: Path) -> Path:
    """The project's packages in one zip, for ``--py-files`` or ``addPyFile``."""
    root = Path(__file__).resolve().parents[2]
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for pkg in PACKAGES:
            for f in sorted((root / pkg).rglob("*")):
                if f.is_file() and "__pycache__" not in f.parts:
                    z.write(f, f.relative_to(root).as_posix())
    return out


def ship_packages(sc: Any) -> Path:
    """Zip the project's packages and add the zip to the executors' Python path."""
    out = package_zip(Path(tempfile.mkdtemp(prefix="queue-ref-ship-")) / "queue_ref.zip")
    sc.addPyFile(str(out))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m conformance.campaign.spark_setup OUT.zip", file=sys.stderr)
        sys.exit(2)
    print(package_zip(Path(sys.argv[1])))
