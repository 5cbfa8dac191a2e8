"""AReaL integration: the environment that holds a real AReaL, exporting a package into it,
and the checks that prove a package inside it."""
