"""From a model to a job folder a person launches: convert runs every pass in a row, emit writes
the folder (plan.json, profile.json, train.py, report.html, README.md).

    settings   ConvertSettings (convert's options, checked in one place) and JobSettings (what train.py is made from)
    converter  convert: check -> load -> flatten -> profile -> partition or search (+ baselines) -> emit
    folder     emit: the job folder, written whole or not at all
    readme     the job folder's README.md
    script     train.py, from templates/train.py (a Python file; its settings block and launch lines filled in)
    doctor     autopipe doctor: profile, plan and train a small GPT-2 here; the plan's figures beside the run's
"""

from __future__ import annotations

from .converter import ConvertResult, convert, default_job_dir
from .folder import JobFiles, check_job_dir, emit
from .script import write_train_script
from .settings import ConvertSettings, JobSettings

__all__ = ["ConvertResult", "ConvertSettings", "JobFiles", "JobSettings", "check_job_dir", "convert",
           "default_job_dir", "emit", "write_train_script"]
