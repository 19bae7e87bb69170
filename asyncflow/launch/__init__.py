"""Launchers: where roles run (:class:`~asyncflow.workflow.launcher.Launcher`). The only package that imports Ray.

* :mod:`~asyncflow.launch.registry`      ``get_launcher(name)``
* :mod:`~asyncflow.launch.local`         every worker an object of this process, roles threads
* :mod:`~asyncflow.launch.ray_launcher`  every worker a Ray actor process
* :mod:`~asyncflow.launch.ray_services`  the Ray-backed data plane and weight store clients
* :mod:`~asyncflow.launch.reaper`        ends the Ray processes a killed driver would leave
"""
