"""From a model to a job folder a person launches: convert runs every pass in a row, emit writes
the folder (plan.json, profile.json, train.py, report.html, README.md).

    converter  convert: load -> flatten -> profile -> partition (+ baselines) -> emit
    folder     emit: the job folder, written whole or not at all
    script     train.py, from the template in templates/
"""

from __future__ import annotations

from .converter import ConvertResult, convert, default_job_dir
from .folder import JobFiles, JobSettings, check_job_dir, emit
from .script import write_train_script

__all__ = ["ConvertResult", "JobFiles", "JobSettings", "check_job_dir", "convert", "default_job_dir", "emit",
           "write_train_script"]
