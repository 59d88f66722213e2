"""`audit`: a pre-flight check of accumulation on the user's own model, loss and step.

`_audit` runs the checks and builds the `AuditReport` (`_report`); `_run` runs the front ends
and the large batch they are judged against, `_step` a user's whole step, `_through` judges an
update through its optimizer; the rows are `_checks` and `_collectives` (read from the compiled
programs), `_keys` the PRNG-key rows. Named `auditing`, not `audit`: `optax_accum.audit` is the
function. Imports every folder below it.
"""

from optax_accum.auditing._audit import audit
from optax_accum.auditing._report import AuditReport

__all__ = ["AuditReport", "audit"]
