package loopback

// Find returns the live agent of that name, or nil. Tests outside this
// module's root package use it to inject faults into a Transport's engine.
func Find(name string) *Agent { return lookup(name) }
