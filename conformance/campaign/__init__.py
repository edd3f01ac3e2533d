"""Crash campaigns: the crash explorer's tasks run as Spark jobs, the results as Parquet.

``queue-ref campaign run`` plans the same tasks as ``queue-ref crash explore``
(``crashexplore.exploration.plan``), splits the long ones by crash point
(``Task.shard``), groups them into partitions and runs each partition as a Spark job whose
executor calls ``crashexplore.crash_task.explore_task``, the function the explorer's worker
processes call, so every verdict is the explorer's.  Each finished partition becomes one
Parquet file of the campaign's dataset (a row per task, crash point and model); a
campaign that was interrupted resumes with the partitions that have no file yet.
``campaign report`` and ``campaign diff`` read the dataset with Spark SQL.

Modules, top to bottom: ``campaign_command`` (the CLI; it imports pyspark only when a
command runs), ``campaign_runner`` (jobs, progress, resume), ``campaign_report_html``
(the page and its plots), ``campaign_sql`` (the summaries), ``spark_setup`` (a
SparkSession with quiet logs), ``campaign_rows`` (what an executor runs and returns, the
Parquet schema), ``campaign_plan`` (parameters, units and partitions; no Spark).
"""
