"""Imported only by the forkserver (a preload module): the server dies with the supervisor that started it.

Without it a `kill -9` of the supervisor leaves the forkserver alive (the resource tracker holds its
"parent alive" pipe open), and with it every worker it forked, hung ones included. Workers ask for
the same (`pool.die_with_parent`), so the whole tree goes.
"""

from harness.fleet.pool import die_with_parent

die_with_parent()
