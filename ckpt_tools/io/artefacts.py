"""The names of the files ckpt-tools itself keeps in an output: read back by every verb, written by the writer."""

MANIFEST_NAME = "ckpt_manifest.json"  # every tensor and file of an output, with its digest
LOCK_NAME = ".ckpt.lock"  # held while a writer runs in the directory
RESUME_NAME = ".ckpt-resume.json"  # what an interrupted run was writing, so --resume can prove it is the same plan
