//! The `recv(2)` and `send(2)` flags a connection honours, as types: a
//! call names the flags it passes instead of a row of booleans.

use std::ops::BitOr;

/// A set of `MSG_*` flags of one call, with the values `recv(2)` and
/// `send(2)` give them.
macro_rules! msg_flags {
    ($(#[$doc:meta])* $name:ident { $($(#[$flag_doc:meta])* $flag:ident = $msg:ident),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct $name(libc::c_int);

        impl $name {
            /// No flag.
            pub const EMPTY: $name = $name(0);
            $($(#[$flag_doc])* pub const $flag: $name = $name(libc::$msg);)+

            /// The flags of this set among `msg`, a call's `MSG_*` bits;
            /// the others are left to the caller.
            pub const fn from_msg(msg: libc::c_int) -> $name {
                $name(msg & (0 $(| libc::$msg)+))
            }

            /// Whether every flag of `other` is set.
            pub const fn contains(self, other: $name) -> bool {
                self.0 & other.0 == other.0
            }
        }

        impl BitOr for $name {
            type Output = $name;
            fn bitor(self, o: $name) -> $name {
                $name(self.0 | o.0)
            }
        }
    };
}

msg_flags! {
    /// The flags of [`Conn::recv`](super::Conn::recv).
    RecvFlags {
        /// `MSG_PEEK`: copy without consuming.
        PEEK = MSG_PEEK,
        /// `MSG_WAITALL`: a blocking call waits for the whole buffer (with
        /// `PEEK`, for as much of it as a ring holds).
        WAITALL = MSG_WAITALL,
        /// `MSG_DONTWAIT`: do not wait, whatever the descriptor's mode.
        DONTWAIT = MSG_DONTWAIT,
    }
}

msg_flags! {
    /// The flags of [`Conn::send`](super::Conn::send).
    SendFlags {
        /// `MSG_DONTWAIT`: do not wait, whatever the descriptor's mode.
        DONTWAIT = MSG_DONTWAIT,
        /// `MSG_MORE`: hold the bytes, as corking does, until a write
        /// without it.
        MORE = MSG_MORE,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_msg_keeps_only_its_own_flags() {
        let msg = libc::MSG_PEEK | libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL | libc::MSG_MORE;
        let r = RecvFlags::from_msg(msg);
        assert_eq!(r, RecvFlags::PEEK | RecvFlags::DONTWAIT);
        assert!(!r.contains(RecvFlags::WAITALL));
        let s = SendFlags::from_msg(msg);
        assert_eq!(s, SendFlags::DONTWAIT | SendFlags::MORE);
        assert!(SendFlags::EMPTY.contains(SendFlags::EMPTY));
        assert!(!SendFlags::EMPTY.contains(SendFlags::MORE));
    }
}
