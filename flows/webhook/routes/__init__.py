"""The webhook's routes, one module per resource, each registered on the app by one function.

Registration order is the order of the OpenAPI document: alarms, external alarms, jobs,
incidents, health.
"""

from flows.webhook.routes.alarms import add_alarm_routes
from flows.webhook.routes.external import add_external_alarm_routes
from flows.webhook.routes.health import add_health_routes
from flows.webhook.routes.incidents import add_incident_routes
from flows.webhook.routes.jobs import add_job_routes

__all__ = [
    "add_alarm_routes",
    "add_external_alarm_routes",
    "add_health_routes",
    "add_incident_routes",
    "add_job_routes",
]
