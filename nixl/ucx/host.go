package ucx

import "github.com/ecxfer/ecxfer/internal/procinfo"

// localHost returns this process's host identity.
func localHost() (hostID, error) {
	var h hostID
	var err error
	if h.Boot, err = procinfo.BootID(maxBootLen); err != nil {
		return hostID{}, err
	}
	if h.NetNS, err = procinfo.NSInode("net"); err != nil {
		return hostID{}, err
	}
	if h.PidNS, err = procinfo.NSInode("pid"); err != nil {
		return hostID{}, err
	}
	return h, nil
}
