//! The typed errors of the connection manager.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

/// What the fix is when an address has no RDMA device behind it.
pub(crate) const NO_DEVICE_HINT: &str = "rdma_cm finds the RDMA device through the IP address: \
     put the address on the netdev the RDMA device is bound to (`rdma link show` names it, e.g. \
     `ip addr add 10.0.0.1/24 dev <netdev>`), and connect to / listen on such an address \
     (Soft-RoCE over `lo` cannot be used by rdma_cm)";

/// Errors of the RDMA connection manager ([`Error::Cm`](crate::Error::Cm)).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CmError {
    /// A librdmacm call failed.
    #[error("{verb} failed")]
    Verb {
        /// The call (`rdma_create_id`, `rdma_listen`, ...).
        verb: &'static str,
        /// OS error.
        #[source]
        source: io::Error,
    },
    /// The address has no RDMA device: no device's netdev carries it (or no route to it
    /// leaves through one).
    #[error("{step} of {addr} failed: no RDMA device for this address; {hint}", hint = NO_DEVICE_HINT)]
    NoDeviceForAddress {
        /// `bind`, `address resolution` or `route resolution`.
        step: &'static str,
        /// The address.
        addr: SocketAddr,
        /// What the kernel said (`ENODEV`, `EADDRNOTAVAIL`, ...).
        #[source]
        source: io::Error,
    },
    /// Address or route resolution failed for another reason.
    #[error("{step} of {addr} failed")]
    Resolve {
        /// `address resolution` or `route resolution`.
        step: &'static str,
        /// The address.
        addr: SocketAddr,
        /// The event's status.
        #[source]
        source: io::Error,
    },
    /// The kernel's rdma_cm interface is missing (`/dev/infiniband/rdma_cm`).
    #[error("rdma_create_event_channel failed: /dev/infiniband/rdma_cm is missing — load the kernel module (`modprobe rdma_ucm`) on a host with an RDMA device")]
    NoCmDevice(#[source] io::Error),
    /// A step did not finish in time.
    #[error("{step} did not finish within {after:?}")]
    Timeout {
        /// What was waited for.
        step: &'static str,
        /// The bound.
        after: Duration,
    },
    /// The peer rejected the connection (also what a port nobody listens on answers, with
    /// the InfiniBand CM reason 8, "invalid service ID").
    #[error("connection rejected by the peer (reason {reason}{})", if *.reason == 8 { ": nobody listens on that port" } else { "" })]
    Rejected {
        /// The CM's reject reason (IB CM `REJ` reason; 28 = rejected by the application).
        reason: i32,
        /// Private data the peer sent with the reject.
        private_data: Vec<u8>,
    },
    /// The peer could not be reached (`RDMA_CM_EVENT_UNREACHABLE`).
    #[error("peer unreachable (status {0})")]
    Unreachable(i32),
    /// The connection could not be established (`RDMA_CM_EVENT_CONNECT_ERROR`).
    #[error("connection error (status {0})")]
    ConnectError(i32),
    /// The peer disconnected (or the connection broke).
    #[error("the peer disconnected")]
    Disconnected,
    /// The RDMA device went away.
    #[error("the RDMA device was removed")]
    DeviceRemoved,
    /// An event that does not belong at this point of the protocol.
    #[error("unexpected rdma_cm event {got} (status {status}) while waiting for {expected}")]
    UnexpectedEvent {
        /// What we waited for.
        expected: &'static str,
        /// The event's name.
        got: &'static str,
        /// Its status.
        status: i32,
    },
    /// An event librdmacm handed out that this crate cannot interpret (unknown type, or a
    /// connect request without a new id).
    #[error("malformed rdma_cm event: {0}")]
    MalformedEvent(String),
    /// Private data longer than the CM message can carry.
    #[error("{len} bytes of private data; {what} carries at most {max}")]
    PrivateDataTooLong {
        /// The message.
        what: &'static str,
        /// Given length.
        len: usize,
        /// Its limit.
        max: usize,
    },
    /// The queue pair was built on another device or port than the connection's.
    #[error("the queue pair is on {qp_device} port {qp_port}, the connection on {cm_device} port {cm_port}: build it from the connection's `queue_pair` builder / `open_context`")]
    WrongDevice {
        /// QP's device.
        qp_device: String,
        /// QP's port.
        qp_port: u8,
        /// Connection's device.
        cm_device: String,
        /// Connection's port.
        cm_port: u8,
    },
}

impl CmError {
    pub(crate) fn verb(verb: &'static str) -> Self {
        CmError::Verb {
            verb,
            source: io::Error::last_os_error(),
        }
    }
}

/// Whether an errno says "no RDMA device has this address".
pub(crate) fn is_no_device(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ENODEV | libc::EADDRNOTAVAIL | libc::ENETUNREACH | libc::EHOSTUNREACH)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_device_error_names_the_fix() {
        let e = CmError::NoDeviceForAddress {
            step: "address resolution",
            addr: "127.0.0.1:7174".parse().unwrap(),
            source: io::Error::from_raw_os_error(libc::ENODEV),
        };
        let msg = e.to_string();
        assert!(msg.contains("127.0.0.1:7174"), "{msg}");
        assert!(msg.contains("ip addr add"), "{msg}");
        assert!(msg.contains("rdma link"), "{msg}");
        let e = CmError::Rejected {
            reason: 8,
            private_data: vec![],
        };
        assert!(e.to_string().contains("nobody listens"), "{e}");
    }
}
