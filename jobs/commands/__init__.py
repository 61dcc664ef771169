"""The command groups of ``clipforge``, one module each: it adds its subcommands and the function each one runs."""
